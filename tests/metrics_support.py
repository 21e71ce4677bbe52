"""Test support for the Prometheus series of the mesh's processes: the naming rules
every exposition must keep, sample look-ups, and each kind of process's registry built
in-process with one of each event recorded (for the naming and dashboard tests)."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# Histograms measure time or size in base units, or count things per event.
HISTOGRAM_UNITS = ("_seconds", "_bytes", "_segments", "_tokens")
# Units that are not base units.
NOT_BASE_UNITS = re.compile(r"_(ms|milliseconds|us|microseconds|minutes|hours|kb|mb|mib|gib)(_|$)")
_NAME = re.compile(r"^mesh_[a-z0-9_]+$")


def naming_problems(text: str) -> list[str]:
    """What in a Prometheus text exposition breaks the mesh's naming rules: names
    outside ``mesh_[a-z0-9_]+``, duplicate families, counter samples that do not end in
    ``_total``, gauges named ``_total``, ``_created`` timestamp series, histograms not
    in seconds, bytes or a count per event, and units that are not base units."""
    problems: list[str] = []
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        name = family.name
        if name in seen:
            problems.append(f"{name}: more than one family of this name")
        seen.add(name)
        if not _NAME.match(name):
            problems.append(f"{name}: not a mesh_[a-z0-9_]+ name")
        if NOT_BASE_UNITS.search(name):
            problems.append(f"{name}: not in base units (seconds, bytes)")
        if name.endswith("_created"):
            problems.append(f"{name}: a _created timestamp series")
        if family.type == "counter":
            problems += [
                f"{name}: counter sample {s.name} does not end in _total"
                for s in family.samples
                if not s.name.endswith("_total")
            ]
        elif family.type == "gauge" and name.endswith("_total"):
            problems.append(f"{name}: a gauge named _total")
        elif family.type == "histogram" and not name.endswith(HISTOGRAM_UNITS):
            problems.append(f"{name}: a histogram not in {', '.join(HISTOGRAM_UNITS)}")
        elif family.type not in ("counter", "gauge", "histogram"):
            problems.append(f"{name}: type {family.type}")
    return problems


def samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when
    there are none)."""
    return sum(
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def series_names(text: str) -> set[str]:
    """Every sample name an exposition can carry, from its families' types (a labelled
    family with no sample yet still names its series)."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


# ---- every kind of process, built in-process ------------------------------------------


def process_expositions() -> dict[str, str]:
    """The exposition of stage 0 (stage, engine and HTTP series in one registry), of a
    later stage and of the coordinator, each with one of every event recorded through
    the objects that record them in a running mesh."""
    return {"stage-0": _stage_zero(), "stage": _stage(), "coordinator": _coordinator()}


def _node(node_id: str):
    from stage.node import NodeSettings, StageNode

    cache = Path(tempfile.mkdtemp(prefix="metrics-"))
    return StageNode(NodeSettings(node_id=node_id, cache_dir=cache), "127.0.0.1:1")


def _frame():
    from mesh.frames import Frame, Segment, SegmentKind

    segments = (
        Segment("r1", "r1", SegmentKind.PREFILL, 0, token_ids=(5, 6, 7)),
        Segment("r2", "r2", SegmentKind.DECODE, 9, token_ids=(8,)),
    )
    return Frame(1, 1, segments)


def _record_stage_events(node) -> None:
    from mesh.errors import StaleTerm

    metrics = node.metrics
    metrics.frame_done(_frame(), 0.001, 0.02)
    metrics.frame_failed(StaleTerm("frame of term 1 dropped: this stage serves term 2"))
    for link in ("forward", "return"):
        metrics.sent[link].count(1024)
        metrics.received[link].count(512)


def _stage() -> str:
    node = _node("stage-1")
    try:
        _record_stage_events(node)
        return generate_latest(node.metrics.registry).decode()
    finally:
        node.stop()


def _stage_zero() -> str:
    import time

    from mesh.frames import FrameResult, SegmentKind, SegmentResult, StageTiming
    from mesh.speculative import AdaptiveWindow, NgramDrafter
    from mesh.types import SamplingParams
    from stage.frontend.backend import GenerationRequest
    from stage.frontend.engine_types import EngineLimits, SentFrame
    from stage.frontend.request_run import RequestRun
    from stage.frontend.scheduler import PipelineScheduler
    from stage.frontend.telemetry import FrontendMetrics

    node = _node("stage-0")
    try:
        _record_stage_events(node)
        scheduler = PipelineScheduler(node, "tiny", EngineLimits())
        http = FrontendMetrics(node.metrics.registry)
        frame = _frame()
        scheduler.metrics.frame_sent(frame)
        sent = SentFrame(1, 1, time.perf_counter(), 4, {"r1"}, {"r1": SegmentKind.DECODE})
        timings = tuple(StageTiming(i, 10.0, 0.5) for i in range(2))
        answer = SegmentResult("r1", "r1", 9, token_ids=(3,))
        scheduler.metrics.result_received(sent, FrameResult(1, 1, (answer,), timings))
        scheduler.metrics.stale(["term"])
        request = GenerationRequest("r1", (1, 2, 1, 2), 8, SamplingParams(), frozenset())
        drafter = NgramDrafter()
        drafter.begin(request.prompt_tokens)
        run = RequestRun(request, (drafter, AdaptiveWindow(4, 1, 8), "ngram"))
        drafts = drafter.propose(2)
        run.observe(drafts, 1, [1, 4], 0.01, 0.0001)
        scheduler.metrics.rounds(run)
        endpoint = "/v1/chat/completions"
        http.requests.labels(endpoint=endpoint, status="200").inc()
        http.request_seconds.labels(endpoint=endpoint).observe(0.5)
        http.in_flight.labels(endpoint=endpoint).inc()
        http.prompt_tokens.labels(endpoint=endpoint).inc(4)
        http.completion_tokens.labels(endpoint=endpoint).inc(2)
        http.generations.labels(endpoint=endpoint, reason="stop_string").inc()
        http.time_to_first_token.labels(endpoint=endpoint).observe(0.1)
        http.time_per_output_token.labels(endpoint=endpoint).observe(0.01)
        return generate_latest(node.metrics.registry).decode()
    finally:
        node.stop()


def _coordinator() -> str:
    from coordinator import registry as reg
    from coordinator.metrics import CoordinatorMetrics
    from coordinator.planner import Plan, StageAssignment
    from mesh.types import LayerRange

    metrics = CoordinatorMetrics()
    state = reg.State()

    def apply(event: reg.Event) -> None:
        nonlocal state
        before, state = state, reg.apply(state, event)
        metrics.observe(before, event, state)

    metrics.watch(lambda: state)
    for index in range(2):
        apply(reg.NodeJoined(node_id=f"n{index}", address=f"10.0.0.{index}:7071", now=0.0))
    plan = Plan(
        tuple(
            StageAssignment(f"n{i}", f"10.0.0.{i}:7071", i, LayerRange(3 * i, 3 * i + 3), 0)
            for i in range(2)
        )
    )
    apply(reg.LoadStarted(term=1, plan=plan))
    for index in range(2):
        apply(reg.StageReady(node_id=f"n{index}", param_bytes=1, term=1, now=0.0))
    apply(reg.LoadSucceeded(term=1))
    apply(reg.HeartbeatsChecked(now=100.0, timeout_s=3.0))
    return generate_latest(metrics.registry).decode()
