"""Stage 0's local stall rule: while the coordinator cannot be reached, a frame that
has waited past the coordinator's stall deadline makes /health say 503 (nothing else
would plan around the stage that holds it); the deadline is the coordinator's
``--stall-timeout``, sent with the Load."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mesh.settings.commands import STALL_TIMEOUT_KEY, sent_stall_timeout
from mesh.settings.sections import CoordinatorConfig
from mesh.types import RESTART_GRACE_S, STALL_ROUND_FACTOR
from stage.frontend.engine_types import EngineLimits, PipelineInfo
from stage.frontend.scheduler import PipelineScheduler, stall_deadline_s
from stage.node import NodeSettings, StageNode, WaitingFrame


@pytest.fixture
def scheduler():
    cache = Path(tempfile.mkdtemp(prefix="local-stall-"))
    node = StageNode(NodeSettings(node_id="stage-0", cache_dir=cache), "127.0.0.1:1")
    try:
        scheduler = PipelineScheduler(node, "tiny", EngineLimits())
        scheduler.stall_timeout_s = 3.0
        yield scheduler
    finally:
        node.stop()


def waited(scheduler: PipelineScheduler, seconds: float, longest_s: float = 0.05) -> None:
    """Stage 0's oldest unanswered frame (7) was sent ``seconds`` ago."""
    scheduler.node.waiting = WaitingFrame(1, 7, time.perf_counter() - seconds, longest_s)


def test_an_overdue_frame_while_the_coordinator_is_unreachable_is_a_reason(scheduler):
    scheduler.node.coordinator_outage = lambda: 12.0
    waited(scheduler, 5.0)
    reason = scheduler._stalled_reason()
    assert reason is not None
    assert "frame 7" in reason and "stall deadline 3 s" in reason
    assert "unreachable for 12 s" in reason


def test_nothing_is_said_while_the_coordinator_answers(scheduler):
    """The coordinator's own stall rule acts then (or knows why not: a big frame
    still crossing a slow link)."""
    scheduler.node.coordinator_outage = lambda: 0.0
    waited(scheduler, 50.0)
    assert scheduler._stalled_reason() is None


def test_the_rule_holds_for_a_while_after_the_coordinator_answers_again(scheduler):
    """A coordinator that answers again takes the judgement over, but a restarted
    one first waits for the stages to join: until it has had its grace and the stall
    timeout to act (or the frame is answered, or a new pipeline loads) /health stays
    503."""
    scheduler.node.coordinator_outage = lambda: 12.0
    waited(scheduler, 5.0)
    assert scheduler._stalled_reason() is not None
    scheduler._stalled = True  # as the engine's timer tick records it
    scheduler.node.coordinator_outage = lambda: 0.0
    reason = scheduler._stalled_reason()
    assert reason is not None and "reachable again for 0 s" in reason
    assert "frame 7" in reason
    # The frame is answered: nothing waits, the rule ends at once.
    scheduler.node.waiting = None
    assert scheduler._stalled_reason() is None
    # Still waiting, and the coordinator has not acted within a restart's grace and
    # the stall timeout (3 s): the judgement is its own from then on.
    waited(scheduler, 9.0)
    scheduler._coordinator_back_at = time.perf_counter() - (RESTART_GRACE_S + 2.0)
    assert scheduler._stalled_reason() is not None
    scheduler._coordinator_back_at = time.perf_counter() - (RESTART_GRACE_S + 3.5)
    assert scheduler._stalled_reason() is None
    # A new outage starts the count again.
    scheduler.node.coordinator_outage = lambda: 1.0
    assert scheduler._stalled_reason() is not None
    assert scheduler._coordinator_back_at is None


def test_nothing_is_said_before_the_deadline(scheduler):
    scheduler.node.coordinator_outage = lambda: 12.0
    waited(scheduler, 2.0)
    assert scheduler._stalled_reason() is None
    scheduler.node.waiting = None
    assert scheduler._stalled_reason() is None


def test_long_rounds_stretch_the_deadline(scheduler):
    """As the coordinator's rule: the larger of the stall timeout and
    STALL_ROUND_FACTOR times the longest recent round."""
    scheduler.node.coordinator_outage = lambda: 12.0
    waited(scheduler, 5.0, longest_s=1.0)
    assert scheduler._stalled_reason() is None
    waited(scheduler, STALL_ROUND_FACTOR * 1.0 + 1.0, longest_s=1.0)
    assert "stall deadline 10 s" in (scheduler._stalled_reason() or "")


def test_frames_given_up_at_the_round_timeout_keep_the_pipeline_stuck(scheduler):
    """Past the round timeout nothing waits any more (its frames were given up), but
    the pipeline has not answered since: still a reason, until an answer of the term
    comes or a new pipeline loads (``EngineCore.unanswered_term``), while the
    requests that lost their frames wait to resume. Once none does, new requests go
    in again: with nothing running no answer could ever come (before, /health said
    503 and every new request waited 60 s for a 503 until a coordinator returned,
    though the stage had woken)."""
    scheduler.node.coordinator_outage = lambda: 130.0
    scheduler.node.waiting = None
    scheduler.core.info = PipelineInfo(term=4, stage_count=2)
    scheduler.core.unanswered_term = 4
    scheduler.core.running["r1"] = SimpleNamespace(recover_by=50.0, failed_term=4)
    reason = scheduler._stalled_reason()
    assert reason is not None and "round timeout" in reason and "term 4" in reason
    del scheduler.core.running["r1"]  # it failed at its recovery deadline
    assert scheduler._stalled_reason() is None
    scheduler.core.running["r1"] = SimpleNamespace(recover_by=50.0, failed_term=4)
    scheduler.node.coordinator_outage = lambda: 0.0
    assert scheduler._stalled_reason() is None
    scheduler.node.coordinator_outage = lambda: 130.0
    scheduler.core.unanswered_term = 3  # an older term's: a new pipeline loaded since
    assert scheduler._stalled_reason() is None


def test_a_stall_timeout_of_0_turns_the_rule_off(scheduler):
    scheduler.node.coordinator_outage = lambda: 12.0
    scheduler.stall_timeout_s = 0.0
    waited(scheduler, 500.0)
    assert scheduler._stalled_reason() is None


def test_the_end_of_a_stall_is_logged_with_what_ended_it(scheduler):
    """A stall ends when the pipeline answers, when the coordinator is back, or when
    a broken link gives the waited-for frame up: the log line says which (the last
    one is no answer: ``/health`` stays 503 with the broken link's reason)."""
    scheduler.node.coordinator_outage = lambda: 12.0
    assert scheduler._stall_ended() == "the pipeline answers again"
    scheduler._loaded = SimpleNamespace(
        link_error="stage 1 is unreachable from stage 0: reset",
        forward=SimpleNamespace(broken=True),
    )
    ended = scheduler._stall_ended()
    assert ended.startswith("the frame it waited for was given up; the pipeline is broken")
    assert "reset" in ended and "waiting for the stages to open the link again" in ended
    scheduler.node.coordinator_outage = lambda: 0.0
    broken = scheduler._broken_reason() or ""
    assert broken.endswith("waiting for the coordinator to load a new one"), broken
    scheduler.node.coordinator_outage = lambda: 0.0
    assert "coordinator is reachable again" in scheduler._stall_ended()


def test_a_frame_that_took_stage_0_long_gets_a_longer_deadline():
    """A long prompt chunk: stage 0's own compute time for it, times the stages,
    is the round it should take (the coordinator's rule without the probes)."""
    assert stall_deadline_s(3.0, 0.05, 0.0, 2) == 3.0
    assert stall_deadline_s(3.0, 0.05, 2.0, 2) == STALL_ROUND_FACTOR * 4.0
    assert stall_deadline_s(3.0, 5.0, 0.1, 3) == STALL_ROUND_FACTOR * 5.0
    assert stall_deadline_s(0.0, 0.0, 0.0, 0) == 0.0


@pytest.mark.parametrize(
    ("sent", "seconds"),
    [
        (((STALL_TIMEOUT_KEY, json.dumps(4.5), "CLI --stall-timeout"),), 4.5),
        (((STALL_TIMEOUT_KEY, json.dumps(0), "CLI --stall-timeout"),), 0.0),
        ((), CoordinatorConfig.stall_timeout),
        (((STALL_TIMEOUT_KEY, '"soon"', "x"),), CoordinatorConfig.stall_timeout),
        (((STALL_TIMEOUT_KEY, "-1", "x"),), CoordinatorConfig.stall_timeout),
        (((STALL_TIMEOUT_KEY, "{", "x"),), CoordinatorConfig.stall_timeout),
    ],
)
def test_the_stall_timeout_sent_with_the_load(sent, seconds):
    """A coordinator that sends none (or something unreadable) leaves the built-in
    default."""
    assert sent_stall_timeout(sent) == seconds
