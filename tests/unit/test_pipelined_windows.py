"""Verify windows drafted ahead, in stage 0's engine core against a fake pipeline
with latency: output identical to plain decoding at every depth and for drafters
that are always, sometimes and never right; refuted windows dropped by the last
stage and never committed; stops and the token budget inside windows in flight;
recovery with windows in flight; the depth rule."""

from __future__ import annotations

import pytest
from engine_support import (
    Clock,
    FakePipeline,
    OracleDrafter,
    greedy,
    request,
    run_with_latency,
)

from mesh.frames import SegmentKind
from mesh.speculative import FixedWindow
from mesh.speculative.depth import DepthInputs, choose_depth, pipelined_rate
from stage.frontend.engine_core import EngineCore
from stage.frontend.engine_types import EngineLimits, PipelineInfo


def make_core(
    wrong: float, max_depth: int, window: int = 4, stage_count: int = 2, seed: int = 0
) -> tuple[EngineCore, Clock]:
    def speculation(req):
        drafter = OracleDrafter(wrong, seed)
        drafter.begin(req.prompt_tokens)
        return drafter, FixedWindow(window), "oracle"

    clock = Clock()
    core = EngineCore(EngineLimits(max_depth=max_depth), clock, speculation)
    core.set_pipeline(PipelineInfo(term=1, stage_count=stage_count))
    return core, clock


PROMPTS = {"a": (3, 1, 4, 1, 5, 9, 2, 6), "b": (2, 7, 1, 8)}


@pytest.mark.parametrize("max_depth", [1, 2, 3, 4])
@pytest.mark.parametrize("wrong", [0.0, 0.03, 0.3, 1.0])
def test_windows_drafted_ahead_give_the_tokens_of_plain_decoding(
    max_depth: int, wrong: float
) -> None:
    for rid, prompt in PROMPTS.items():
        core, clock = make_core(wrong, max_depth, seed=len(prompt))
        pipe = FakePipeline(step_ms=10.0)
        run = core.add(request(rid, prompt, max_new=60))
        got = run_with_latency(core, pipe, clock, round_s=0.08)
        assert got[rid][0] == greedy(prompt, 60) and got[rid][1] == "length"
        assert not pipe.sessions, "every session ended on the pipeline"
        ahead = [s for f in pipe.frames for s in f.segments if s.ahead]
        if max_depth == 1:
            assert not ahead
        elif wrong <= 0.03:
            assert ahead and run.deepest > 1
        dropped = {(s.session_id, s.pos_start, s.epoch) for s in pipe.dropped}
        assert core.ahead.dropped_by_last_stage == len(pipe.dropped)
        assert core.ahead.dropped + core.ahead.kept <= core.ahead.sent
        if wrong == 0.0:
            assert not dropped, "a perfect drafter's windows all survive"
        # Every window the pipeline dropped was voided here too.
        assert run.ahead_dropped >= len(dropped)


def simulated_seconds(wrong: float, max_depth: int) -> tuple[float, EngineCore]:
    core, clock = make_core(wrong, max_depth, seed=3)
    pipe = FakePipeline(step_ms=10.0)
    core.add(request("a", PROMPTS["a"], max_new=200))
    started = clock.now
    run_with_latency(core, pipe, clock, round_s=0.08)
    return clock.now - started, core


def test_deeper_windows_pay_when_drafts_survive_and_back_off_when_they_do_not() -> None:
    # Simulated time (the fake pipeline's clock), not measured time.
    serial, _ = simulated_seconds(0.0, 1)
    deep, core = simulated_seconds(0.0, 4)
    assert deep < serial / 2 and core.ahead.dropped == 0
    _, never = simulated_seconds(1.0, 4)
    assert never.ahead.sent == 0


def test_a_stop_token_inside_a_window_in_flight_ends_cleanly() -> None:
    prompt = (5, 6, 7, 8)
    expected = greedy(prompt, 40)
    stop_at = expected[25]
    core, clock = make_core(0.0, 4)
    pipe = FakePipeline(step_ms=5.0)
    core.add(request("s", prompt, max_new=40, stop={stop_at}))
    got = run_with_latency(core, pipe, clock, round_s=0.05)
    assert got["s"][0] == expected[: expected.index(stop_at)] and got["s"][1] == "stop"
    assert not pipe.sessions
    assert not core.running


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_the_token_budget_inside_windows_in_flight(max_new: int) -> None:
    prompt = (4, 4, 2)
    core, clock = make_core(0.0, 4, window=3)
    pipe = FakePipeline(step_ms=5.0)
    core.add(request("m", prompt, max_new=max_new))
    got = run_with_latency(core, pipe, clock, round_s=0.05)
    assert got["m"][0] == greedy(prompt, max_new) and got["m"][1] == "length"
    assert not pipe.sessions


def test_a_lost_pipeline_with_windows_in_flight_recovers_identically() -> None:
    prompt = (1, 2, 3, 4, 5)
    core, clock = make_core(0.2, 4)
    pipe = FakePipeline(step_ms=5.0)
    core.add(request("r", prompt, max_new=50))
    committed: list[int] = []
    in_pipe = []
    for _ in range(40):  # until windows ahead are in flight
        while (frame := core.next_frame()) is not None:
            in_pipe.append(frame)
        if any(t.ahead for t in core.running.values()) and len(committed) > 5:
            break
        frame = in_pipe.pop(0)
        clock.now += 0.05
        for outcome in core.on_result(pipe.answer(frame)):
            committed.extend(outcome.event.token_ids)
    assert any(t.ahead for t in core.running.values())
    core.set_pipeline(PipelineInfo(term=2, stage_count=2))
    fresh = FakePipeline(step_ms=5.0)
    rest = run_with_latency(core, fresh, clock, round_s=0.05)
    assert committed + rest["r"][0] == greedy(prompt, 50)
    assert core.recoveries == 1


def test_many_streams_fill_the_pipe_without_windows_ahead() -> None:
    core, clock = make_core(0.0, 4, stage_count=2)
    pipe = FakePipeline(step_ms=5.0)
    prompts = {f"r{i}": (i + 1, i + 3, i + 5) for i in range(3)}
    for rid, prompt in prompts.items():
        core.add(request(rid, prompt, max_new=30))
    got = run_with_latency(core, pipe, clock, round_s=0.05)
    for rid, prompt in prompts.items():
        assert got[rid][0] == greedy(prompt, 30)
    # Three requests decoding on two stages: the batch fills the pipe until only one
    # is left.
    assert core.ahead.sent < sum(1 for f in pipe.frames for s in f.segments if s.ahead) + 1
    first_frames = pipe.frames[:4]
    assert not any(s.ahead for f in first_frames for s in f.segments)


def test_the_depth_rule() -> None:
    sure = DepthInputs(acceptance=0.95, window=4, round_s=0.08, step_s=0.01)
    # A long round trip, a short step, drafts nearly sure: deep.
    assert choose_depth(sure, 8) >= 4
    # No deeper than the round trip holds steps.
    short = DepthInputs(acceptance=0.95, window=4, round_s=0.02, step_s=0.01)
    assert choose_depth(short, 8) == 2
    # Drafts that are rarely right: serial windows.
    poor = DepthInputs(acceptance=0.2, window=4, round_s=0.08, step_s=0.01)
    assert choose_depth(poor, 8) == 1
    # Nothing measured yet, or depth capped: 1.
    assert choose_depth(DepthInputs(0.95, 4, 0.0, 0.01), 8) == 1
    assert choose_depth(sure, 1) == 1
    # The rate grows with depth until the round trip is full, never past it.
    rates = [pipelined_rate(sure, d) for d in range(1, 12)]
    assert rates == sorted(rates) and rates[-1] == rates[7]


def test_a_window_ahead_is_only_sent_after_a_decode_or_verify_window() -> None:
    core, clock = make_core(0.0, 4)
    pipe = FakePipeline(step_ms=5.0)
    core.add(request("p", (9, 8, 7, 6), max_new=20))
    run_with_latency(core, pipe, clock, round_s=0.05)
    segments = [s for f in pipe.frames for s in f.segments]
    prefill_frames = {
        i
        for i, f in enumerate(pipe.frames)
        if any(s.kind is SegmentKind.PREFILL for s in f.segments)
    }
    for index in prefill_frames:
        assert not any(s.ahead for s in pipe.frames[index].segments)
    assert any(s.ahead for s in segments)


def test_a_request_reports_its_windows_ahead() -> None:
    core, clock = make_core(0.03, 4, seed=5)
    pipe = FakePipeline(step_ms=10.0)
    run = core.add(request("t", PROMPTS["a"], max_new=120))
    run_with_latency(core, pipe, clock, round_s=0.08)
    stats = run.stats().speculation
    assert stats["windows_ahead"] == run.ahead_sent == core.ahead.sent > 0
    assert stats["windows_dropped"] == core.ahead.dropped
    assert stats["wasted_tokens"] == core.ahead.wasted_tokens
    assert stats["depth"] == run.deepest > 1


def test_windows_ahead_in_flight_when_the_client_leaves_count_as_wasted() -> None:
    """A request cancelled (its client gone, or a stop string cut in the HTTP layer)
    while windows ahead are in flight: their rows were computed for nothing, counted
    for the mesh and in the request's own ``wasted_tokens`` alike (before, only a
    request that ended on its own last token counted them, and only for the mesh)."""
    from collections import deque

    core, clock = make_core(0.0, 4, seed=2)
    pipe = FakePipeline(step_ms=10.0)
    run = core.add(request("c", PROMPTS["a"], max_new=200))
    pending: deque = deque()
    for _ in range(400):
        while (frame := core.next_frame()) is not None:
            pending.append(frame)
        tracked = core.running.get("c")
        if tracked is not None and tracked.ahead and run.produced > 10:
            break
        clock.now += 0.02
        core.on_result(pipe.answer(pending.popleft()))
    else:
        raise AssertionError("no window was ever drafted ahead")
    in_flight = sum(f.segment.token_count for f in core.running["c"].ahead)
    before = core.ahead.wasted_tokens
    core.cancel("c")
    assert core.ahead.wasted_tokens == before + in_flight > before
    assert run.ahead_wasted == core.ahead.wasted_tokens
    assert run.stats().speculation["wasted_tokens"] == run.ahead_wasted
