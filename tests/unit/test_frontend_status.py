"""What the status page reports, without servers: the pipeline's recent activity
from the answers stage 0 receives, the event log, the changes between coordinator
answers, and the JSON document built from them."""

from __future__ import annotations

import logging

import pytest

from mesh.codec import StageStatus, StatusReply
from mesh.frames import FrameResult, StageTiming
from mesh.types import LayerRange
from stage.frontend.backend import TokenEvent
from stage.frontend.engine_types import Outcome, SentFrame
from stage.frontend.status import (
    EventLog,
    PipelineActivity,
    WarningEvents,
    coordinator_changes,
)
from stage.frontend.status_view import LocalStatus, SpeculationStatus, status_document


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sent(frame_id: int, term: int, at: float) -> SentFrame:
    return SentFrame(frame_id, term, at, rows=1, outstanding=set(), kinds={})


def answer(frame_id: int, term: int, *timings: tuple[int, float, float]) -> FrameResult:
    return FrameResult(term, frame_id, (), tuple(StageTiming(*t) for t in timings))


def tokens(*counts: int) -> list[Outcome]:
    return [Outcome(f"r{i}", event=TokenEvent(tuple(range(n)))) for i, n in enumerate(counts)]


def test_activity_means_each_stages_times_and_the_round() -> None:
    clock = Clock()
    activity = PipelineActivity(clock, window_s=10.0, frames=2)
    activity.observe(answer(1, 1, (0, 4.0, 1.0), (1, 10.0, 3.0)), sent(1, 1, 99.99), tokens(1))
    clock.now = 100.5
    activity.observe(answer(2, 1, (0, 6.0, 0.0), (1, 20.0, 1.0)), sent(2, 1, 100.47), tokens(2))
    times = activity.stage_times()
    assert (times[0].step_ms, times[0].queue_ms, times[0].frames) == (5.0, 0.5, 2)
    assert (times[1].step_ms, times[1].queue_ms) == (15.0, 2.0)
    assert activity.round_ms() == pytest.approx(20.0)
    # Only the last ``frames`` frames count.
    activity.observe(answer(3, 1, (0, 8.0, 0.0), (1, 30.0, 0.0)), sent(3, 1, 100.5), [])
    assert activity.stage_times()[1].step_ms == 25.0


def test_activity_counts_tokens_over_its_window() -> None:
    clock = Clock()
    activity = PipelineActivity(clock, window_s=10.0)
    assert activity.tokens_per_s() == 0.0
    activity.observe(answer(1, 1, (0, 1.0, 0.0)), sent(1, 1, 99.0), tokens(3, 4))
    clock.now = 105.0
    # An answer to no frame in flight (stale) still carries the tokens it committed.
    activity.observe(answer(9, 1), None, tokens(13))
    assert activity.tokens_per_s() == pytest.approx(2.0)
    clock.now = 110.5
    assert activity.tokens_per_s() == pytest.approx(1.3)
    assert activity.tokens_total == 20
    snapshot = activity.snapshot()
    assert (snapshot.tokens_total, snapshot.window_s, snapshot.term) == (20, 10.0, 1)


def test_activity_starts_afresh_with_a_new_term_and_ignores_stale_timings() -> None:
    activity = PipelineActivity(Clock())
    activity.observe(answer(1, 1, (0, 1.0, 0.0), (1, 2.0, 0.0)), sent(1, 1, 99.0), [])
    activity.observe(answer(2, 1, (0, 50.0, 0.0)), None, [])
    activity.observe(answer(3, 1, (0, 50.0, 0.0)), sent(3, 2, 99.0), [])
    assert activity.stage_times()[0].step_ms == 1.0
    activity.observe(answer(4, 2, (0, 7.0, 0.0)), sent(4, 2, 99.0), [])
    assert activity.term == 2
    assert list(activity.stage_times()) == [0]
    assert activity.stage_times()[0].step_ms == 7.0


def test_event_log_is_newest_first_counts_repeats_in_a_row_and_keeps_a_limit() -> None:
    clock = Clock(1000.0)
    log = EventLog(limit=3, clock=clock)
    log.add("load", "pipeline loaded")
    clock.now = 1001.0
    log.add("warning", "request a: lost", key="lost")
    clock.now = 1002.0
    log.add("warning", "request b: lost", key="lost")
    events = log.events()
    assert [(e.kind, e.message, e.count, e.time) for e in events] == [
        ("warning", "request b: lost", 2, 1002.0),
        ("load", "pipeline loaded", 1, 1000.0),
    ]
    # Only in a row: the same event after another one is a line of its own.
    log.add("mesh", "serving -> loading")
    log.add("warning", "request c: lost", key="lost")
    assert [(e.message, e.count) for e in log.events()] == [
        ("request c: lost", 1),
        ("serving -> loading", 1),
        ("request b: lost", 2),
    ]


def test_warnings_become_events_one_per_message_template() -> None:
    log = EventLog()
    handler = WarningEvents(log)
    logger = logging.getLogger("test.status.warnings")
    logger.addHandler(handler)
    try:
        logger.info("not an event")
        logger.warning("request %s: pipeline lost", "a")
        logger.warning("request %s: pipeline lost", "b")
        logger.error("the return link broke")
    finally:
        logger.removeHandler(handler)
    assert [(e.kind, e.message, e.count) for e in log.events()] == [
        ("error", "the return link broke", 1),
        ("warning", "request b: pipeline lost", 2),
    ]


def node(node_id: str, index: int | None, health: str = "alive", **fields) -> StageStatus:
    placed = (
        {
            "assigned": True,
            "stage_index": index,
            "layer_range": LayerRange(3 * index, 3 * index + 3),
        }
        if index is not None
        else {}
    )
    return StageStatus(node_id, f"10.0.0.{len(node_id)}:7071", health=health, **placed, **fields)


def reply(*stages: StageStatus, state: str = "serving", term: int = 1, error: str = ""):
    return StatusReply("coord-1", state, "tiny", "/pkg", term, error, stages=stages)


def test_coordinator_changes_name_failovers_returns_and_joins() -> None:
    first = reply(node("head", 0), node("w1", 1))
    assert coordinator_changes(None, first) == []
    lost = reply(node("head", 0), node("w1", None, "dead"), state="loading")
    assert coordinator_changes(first, lost) == [
        (
            "failover",
            "node w1 (10.0.0.2:7071) missed its heartbeats; it held stage 1, layers [3, 6)",
        ),
        ("mesh", "mesh state serving -> loading"),
    ]
    back = reply(node("head", 0), node("w1", None), node("spare", None), term=2)
    assert coordinator_changes(lost, back) == [
        ("node", "node w1 (10.0.0.2:7071) is back"),
        ("node", "node spare joined from 10.0.0.5:7071"),
        ("mesh", "mesh state loading -> serving"),
    ]
    failed = reply(node("head", 0), state="failed", error="stage 1 failed to load")
    assert coordinator_changes(back, failed)[-1] == ("error", "stage 1 failed to load")
    assert coordinator_changes(failed, failed) == []


def local(**fields) -> LocalStatus:
    base = dict(
        node_id="head",
        address="10.0.0.4:7071",
        coordinator="10.0.0.1:7070",
        ready=True,
        model_id="tiny",
        term=1,
        stage_count=2,
        layer_range=LayerRange(0, 3),
        kv_bytes=2048,
        prefix_bytes=512,
        sessions=1,
        speculation=SpeculationStatus("smol-ngram", "cost", (), drafted=8, accepted=6, windows=2),
    )
    return LocalStatus(**{**base, **fields})


def activity_of(term: int):
    activity = PipelineActivity(Clock())
    activity.observe(answer(1, term, (0, 4.0, 1.0), (1, 9.0, 2.0)), sent(1, term, 99.99), tokens(5))
    return activity.snapshot()


def test_the_document_lists_stages_in_order_with_their_times() -> None:
    coordinator = reply(
        node("w1", 1, kv_bytes=4096, prefix_bytes=1, active_sessions=1, param_bytes=10),
        node("spare", None, "dead", state="unreachable"),
        node(
            "head",
            0,
            kv_bytes=1,
            prefix_bytes=1,
            memory_bytes=1 << 30,
            memory_source="measured",
            planned_step_ms=3.5,
        ),
    )
    doc = status_document(local(), coordinator, "", activity_of(1), [], now=5.0)
    assert [(s["index"], s["node_id"], s["layers"]) for s in doc["stages"]] == [
        (0, "head", [0, 3]),
        (1, "w1", [3, 6]),
    ]
    head, w1 = doc["stages"]
    # Stage 0's own KV is read live; the others' come with their heartbeats.
    assert (head["kv_bytes"], head["prefix_bytes"], head["sessions"]) == (2048, 512, 1)
    assert (w1["kv_bytes"], w1["prefix_bytes"], w1["param_bytes"]) == (4096, 1, 10)
    assert (head["step_ms"], head["queue_ms"], w1["step_ms"], w1["queue_ms"]) == (4, 1, 9, 2)
    # The coordinator's planned step time and the memory figure beside the measured time.
    assert (head["planned_step_ms"], w1["planned_step_ms"]) == (3.5, None)
    assert (head["memory_bytes"], head["memory_source"]) == (1 << 30, "measured")
    assert [n["node_id"] for n in doc["spare_nodes"]] == ["spare"]
    assert doc["mesh"]["reachable"] and doc["mesh"]["state"] == "serving"
    assert doc["throughput"]["tokens_total"] == 5
    assert doc["speculation"]["accept_rate"] == 0.75
    assert doc["model"]["id"] == "tiny" and doc["model"]["package"] == "/pkg"


def test_the_document_shows_no_times_of_another_term() -> None:
    doc = status_document(local(), reply(node("head", 0), term=2), "", activity_of(1), [], 5.0)
    assert doc["stages"][0]["step_ms"] is None and doc["stages"][0]["frames"] == 0


def test_without_the_coordinator_the_document_shows_what_stage_0_knows() -> None:
    nothing = SpeculationStatus()
    doc = status_document(
        local(speculation=nothing), None, "UNAVAILABLE: connection refused", activity_of(1), [], 5
    )
    assert doc["mesh"] == {
        "coordinator": "10.0.0.1:7070",
        "reachable": False,
        "unreachable_reason": "UNAVAILABLE: connection refused",
        "coordinator_id": "",
        "state": "",
        "term": 1,
        "error": "",
        "waiting_for": "",
    }
    first, second = doc["stages"]
    assert (first["node_id"], first["layers"], first["kv_bytes"], first["step_ms"]) == (
        "head",
        [0, 3],
        2048,
        4.0,
    )
    assert (second["index"], second["state"], second["step_ms"]) == (1, "unknown", 9.0)
    assert doc["speculation"]["strategy"] == "" and doc["speculation"]["accept_rate"] is None
    idle = status_document(local(layer_range=None, ready=False), None, "", activity_of(1), [], 5)
    assert idle["stages"] == []


def test_a_stalled_node_is_a_failover_and_its_return_a_node_event() -> None:
    first = reply(node("head", 0), node("w1", 1))
    stalled = reply(node("head", 0), node("w1", None, "stalled"), state="loading")
    assert coordinator_changes(first, stalled)[0] == (
        "failover",
        "node w1 (10.0.0.2:7071) stopped passing frames on; it held stage 1, layers [3, 6) "
        "(left out of plans for a while)",
    )
    back = reply(node("head", 0), node("w1", 1), term=2)
    assert ("node", "node w1 (10.0.0.2:7071) is back") in coordinator_changes(stalled, back)
