"""The coordinator's status as data (mirroring ``StatusReply``) and as a readable table.

``StatusView`` and ``StageStatusView`` carry the same fields as the proto messages
``StatusReply`` and ``StageStatus``, so the server builds them from the registry
with ``status_from_state`` and the ``status`` command renders what it received
with ``render_status``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.registry import State
from mesh.types import LayerRange

MIB = float(1 << 20)
GIB = float(1 << 30)

COLUMNS = (
    "stage",
    "node",
    "address",
    "device",
    "layers",
    "health",
    "state",
    "term",
    "heartbeat",
    "params",
    "kv",
    "memory",
    "step",
    "sessions",
    "slice",
)


@dataclass(frozen=True)
class StageStatusView:
    node_id: str
    address: str
    device: str
    memory_bytes: int
    assigned: bool
    stage_index: int
    layer_range: LayerRange | None
    health: str
    state: str
    term: int
    heartbeat_age_s: float
    param_bytes: int
    active_sessions: int
    slice_bytes_done: int = 0
    slice_bytes_total: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    memory_source: str = ""
    # Step time of the stage (ms): planned (coordinator/balance.py) and measured.
    planned_step_ms: float = 0.0
    measured_step_ms: float = 0.0
    # The node's step probe at its last load: one decoder layer, the LM head.
    layer_ms: float = 0.0
    head_ms: float = 0.0


@dataclass(frozen=True)
class StatusView:
    coordinator_id: str
    model_id: str
    package_ref: str
    term: int
    state: str
    error: str
    http_url: str
    layer_count: int
    stages: tuple[StageStatusView, ...]
    waiting_for: str = ""


def status_from_state(state: State, *, now: float, coordinator_id: str = "") -> StatusView:
    """Assigned nodes first in stage order, then the other nodes in join order."""
    rows: list[tuple[tuple[int, int], StageStatusView]] = []
    for join_index, record in enumerate(state.nodes):
        stage = state.topology.stage_of(record.node_id) if state.topology else None
        rows.append(
            (
                (0, stage.stage_index) if stage else (1, join_index),
                StageStatusView(
                    node_id=record.node_id,
                    address=record.address,
                    device=record.device,
                    memory_bytes=record.memory_bytes,
                    assigned=stage is not None,
                    stage_index=stage.stage_index if stage else 0,
                    layer_range=stage.layer_range if stage else None,
                    health=record.health,
                    # A dead node's last report says nothing about it now.
                    state=record.stage_state if record.health != "dead" else "unreachable",
                    term=record.accepted_term,
                    heartbeat_age_s=max(0.0, now - record.last_heartbeat_at),
                    param_bytes=record.param_bytes,
                    active_sessions=record.active_sessions,
                    slice_bytes_done=record.slice_bytes_done,
                    slice_bytes_total=record.slice_bytes_total,
                    kv_bytes=record.kv_bytes,
                    prefix_bytes=record.prefix_bytes,
                    memory_source=record.memory_source,
                    layer_ms=record.layer_ms,
                    head_ms=record.head_ms,
                ),
            )
        )
    return StatusView(
        coordinator_id=coordinator_id,
        model_id=state.model_id,
        package_ref=state.package_ref,
        term=state.term,
        state=state.mesh_state,
        error=state.error,
        http_url=state.http_url,
        layer_count=state.layer_count,
        stages=tuple(view for _, view in sorted(rows, key=lambda row: row[0])),
    )


def render_status(
    status: StatusView | State, *, now: float | None = None, coordinator_id: str = ""
) -> str:
    """Header lines and one table row per node. A ``State`` needs ``now`` (its clock)."""
    if isinstance(status, State):
        if now is None:
            raise ValueError("render_status(state) needs now= on the clock the events used")
        status = status_from_state(status, now=now, coordinator_id=coordinator_id)
    model = status.model_id or "(none)"
    if status.package_ref and status.package_ref != status.model_id:
        model += f" from {status.package_ref}"
    if status.layer_count:
        model += f", {status.layer_count} layers"
    header = [
        f"model:       {model}",
        f"term:        {status.term}",
        f"mesh state:  {status.state}",
        f"http url:    {status.http_url or '-'}",
    ]
    if status.coordinator_id:
        header.insert(0, f"coordinator: {status.coordinator_id}")
    if status.error:
        header.append(f"error:       {status.error}")
    if status.waiting_for:
        header.append(f"waiting for: {status.waiting_for}")
    if not status.stages:
        return "\n".join(header + ["", "no nodes have joined"]) + "\n"
    table = _table([_row(stage) for stage in status.stages])
    return "\n".join(header + [""] + table) + "\n"


def _row(stage: StageStatusView) -> tuple[str, ...]:
    return (
        str(stage.stage_index) if stage.assigned else "-",
        stage.node_id,
        stage.address,
        stage.device or "-",
        str(stage.layer_range) if stage.assigned and stage.layer_range else "-",
        stage.health,
        stage.state or "-",
        str(stage.term),
        f"{stage.heartbeat_age_s:.1f}s ago",
        f"{stage.param_bytes / MIB:.1f} MiB",
        f"{(stage.kv_bytes + stage.prefix_bytes) / MIB:.1f} MiB",
        _memory(stage),
        _step(stage),
        str(stage.active_sessions),
        _slice(stage),
    )


def _memory(stage: StageStatusView) -> str:
    """e.g. "16.0 GiB measured", "8.0 GiB stated", "unknown"."""
    if not stage.memory_bytes:
        return "unknown"
    return f"{stage.memory_bytes / GIB:.1f} GiB {stage.memory_source}".rstrip()


def _step(stage: StageStatusView) -> str:
    """Planned / measured step time, e.g. "4.1/4.6ms"; "-" for what is not known."""
    if not stage.assigned or not (stage.planned_step_ms or stage.measured_step_ms):
        return "-"
    planned = f"{stage.planned_step_ms:.1f}" if stage.planned_step_ms else "-"
    measured = f"{stage.measured_step_ms:.1f}" if stage.measured_step_ms else "-"
    return f"{planned}/{measured}ms"


def _slice(stage: StageStatusView) -> str:
    """Slice progress: "-" before any, a percentage while it is fetched, "ready"."""
    if not stage.slice_bytes_total:
        return "-"
    if stage.slice_bytes_done >= stage.slice_bytes_total:
        return "ready"
    done, total = stage.slice_bytes_done / MIB, stage.slice_bytes_total / MIB
    return f"{100 * done / total:.0f}% of {total:.1f} MiB"


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))

    return [line(COLUMNS).rstrip(), line(["-" * w for w in widths])] + [
        line(row).rstrip() for row in rows
    ]
