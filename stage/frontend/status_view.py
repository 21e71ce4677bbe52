"""The status page's JSON document (``GET /status.json``), built from what stage 0
knows of itself (``LocalStatus``), the coordinator's last ``StatusReply`` and the
pipeline's recent activity (stage/frontend/status.py). A pure function: the page's
every field is documented in docs/operations.md, "Status page"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.codec import StageStatus, StatusReply
from mesh.types import LayerRange
from stage.frontend.status import ActivitySnapshot, StageTimes, StatusEvent


@dataclass(frozen=True)
class SpeculationStatus:
    """``strategy``: the drafter in use ("" when speculation is off); ``notes``: why
    it differs from what was configured; counters of the decode rounds of every
    request since the frontend started."""

    strategy: str = ""
    policy: str = ""
    notes: tuple[str, ...] = ()
    drafted: int = 0
    accepted: int = 0
    windows: int = 0


@dataclass(frozen=True)
class LocalStatus:
    """What stage 0 knows of itself and its pipeline, read on its event loop."""

    node_id: str
    address: str
    coordinator: str
    ready: bool
    reason: str = ""
    model_id: str = ""
    package_ref: str = ""
    dtype: str = ""
    # The package's weights: its dtype, or the kind of its quantised linears.
    weights: str = ""
    wire_dtype: str = ""
    device: str = ""
    context_length: int = 0
    layer_count: int = 0
    term: int = 0
    stage_count: int = 0
    layer_range: LayerRange | None = None
    param_bytes: int = 0
    sessions: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    uptime_s: float = 0.0
    # Since the loaded pipeline was loaded (0 while none is).
    pipeline_uptime_s: float = 0.0
    running: int = 0
    queued: int = 0
    max_running: int = 0
    max_queued: int = 0
    recoveries: int = 0
    speculation: SpeculationStatus = SpeculationStatus()


def status_document(
    local: LocalStatus,
    coordinator: StatusReply | None,
    coordinator_error: str,
    activity: ActivitySnapshot,
    events: list[StatusEvent],
    now: float,
) -> dict[str, Any]:
    """The whole document; ``coordinator`` is None when it could not be asked
    (``coordinator_error`` says why), and the stages are then what stage 0 knows."""
    if coordinator is not None:
        assigned = [s for s in coordinator.stages if s.assigned]
        assigned.sort(key=lambda s: s.stage_index)
        times = activity.stages if activity.term == coordinator.term else {}
        stages = [_stage_row(local, s, times.get(s.stage_index)) for s in assigned]
        spare = [_spare_row(s) for s in coordinator.stages if not s.assigned]
    else:
        times = activity.stages if activity.term == local.term else {}
        stages = _local_rows(local, times)
        spare = []
    spec = local.speculation
    return {
        "generated_at": now,
        "node_id": local.node_id,
        "ready": local.ready,
        "reason": local.reason,
        "uptime_s": local.uptime_s,
        "pipeline_uptime_s": local.pipeline_uptime_s,
        "model": {
            "id": local.model_id or (coordinator.model_id if coordinator else ""),
            "package": (coordinator.package_ref if coordinator else "") or local.package_ref,
            "layer_count": (coordinator.layer_count if coordinator else 0) or local.layer_count,
            "dtype": local.dtype,
            "weights": local.weights,
            "wire_dtype": local.wire_dtype,
            "device": local.device,
            "context_length": local.context_length,
        },
        "mesh": {
            "coordinator": local.coordinator,
            "reachable": coordinator is not None,
            "unreachable_reason": coordinator_error if coordinator is None else "",
            "coordinator_id": coordinator.coordinator_id if coordinator else "",
            "state": coordinator.state if coordinator else "",
            "term": coordinator.term if coordinator else local.term,
            "error": coordinator.error if coordinator else "",
            "waiting_for": coordinator.waiting_for if coordinator else "",
        },
        "stages": stages,
        "spare_nodes": spare,
        "throughput": {
            "tokens_per_s": activity.tokens_per_s,
            "window_s": activity.window_s,
            "tokens_total": activity.tokens_total,
            "round_ms": activity.round_ms,
        },
        "requests": {
            "running": local.running,
            "queued": local.queued,
            "max_running": local.max_running,
            "max_queued": local.max_queued,
            "recoveries": local.recoveries,
        },
        "speculation": {
            "strategy": spec.strategy,
            "policy": spec.policy,
            "notes": list(spec.notes),
            "drafted": spec.drafted,
            "accepted": spec.accepted,
            "windows": spec.windows,
            "accept_rate": spec.accepted / spec.drafted if spec.drafted else None,
        },
        "events": [
            {"time": e.time, "kind": e.kind, "message": e.message, "count": e.count} for e in events
        ],
    }


def _layers(layer_range: LayerRange | None) -> list[int] | None:
    return [layer_range.start, layer_range.end] if layer_range is not None else None


def _times(times: StageTimes | None) -> dict[str, Any]:
    if times is None:
        return {"step_ms": None, "queue_ms": None, "frames": 0}
    return {"step_ms": times.step_ms, "queue_ms": times.queue_ms, "frames": times.frames}


def _stage_row(local: LocalStatus, stage: StageStatus, times: StageTimes | None) -> dict[str, Any]:
    """A stage as the coordinator reported it; stage 0's own sessions and KV are
    read live."""
    own = stage.node_id == local.node_id
    return {
        "index": stage.stage_index,
        "node_id": stage.node_id,
        "address": stage.address,
        "device": stage.device,
        "layers": _layers(stage.layer_range),
        "health": stage.health,
        "state": stage.state,
        "term": stage.term,
        "heartbeat_age_s": stage.heartbeat_age_s,
        "param_bytes": stage.param_bytes,
        "kv_bytes": local.kv_bytes if own else stage.kv_bytes,
        "prefix_bytes": local.prefix_bytes if own else stage.prefix_bytes,
        "sessions": local.sessions if own else stage.active_sessions,
        "memory_bytes": stage.memory_bytes or None,
        "memory_source": stage.memory_source,
        # The coordinator's estimate of this stage's step time (coordinator/balance.py).
        "planned_step_ms": stage.planned_step_ms or None,
        **_times(times),
    }


def _spare_row(stage: StageStatus) -> dict[str, Any]:
    return {
        "node_id": stage.node_id,
        "address": stage.address,
        "device": stage.device,
        "health": stage.health,
        "state": stage.state,
        "term": stage.term,
        "heartbeat_age_s": stage.heartbeat_age_s,
    }


def _local_rows(local: LocalStatus, times: dict[int, StageTimes]) -> list[dict[str, Any]]:
    """Without the coordinator: stage 0's own row, and the other stages' timings."""
    if local.layer_range is None:
        return []
    rows = [
        {
            "index": 0,
            "node_id": local.node_id,
            "address": local.address,
            "device": local.device,
            "layers": _layers(local.layer_range),
            "health": "alive",
            "state": "serving" if local.ready else "idle",
            "term": local.term,
            "heartbeat_age_s": None,
            "param_bytes": local.param_bytes,
            "kv_bytes": local.kv_bytes,
            "prefix_bytes": local.prefix_bytes,
            "sessions": local.sessions,
            "memory_bytes": None,
            "memory_source": "",
            "planned_step_ms": None,
            **_times(times.get(0)),
        }
    ]
    for index in range(1, local.stage_count):
        rows.append(
            {
                "index": index,
                "node_id": "",
                "address": "",
                "device": "",
                "layers": None,
                "health": "unknown",
                "state": "unknown",
                "term": local.term,
                "heartbeat_age_s": None,
                "param_bytes": None,
                "kv_bytes": None,
                "prefix_bytes": None,
                "sessions": None,
                "memory_bytes": None,
                "memory_source": "",
                "planned_step_ms": None,
                **_times(times.get(index)),
            }
        )
    return rows
