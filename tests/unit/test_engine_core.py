"""Stage 0's engine core against a fake pipeline: admission, the step budget, the
order of segments, commits, cancellation, stale answers and recovery after a reload.

The fake pipeline is a deterministic "model" over each session's tokens (the next
token is a hash of the tokens so far), applying the same crop rule and the same
verification rule as the real stages; it answers every segment of a frame.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from engine_support import (
    Clock,
    FakePipeline,
    collect,
    core_with,
    greedy,
    next_token,
    request,
    run_pipelined,
    run_streaming,
    run_to_end,
)

from mesh.errors import CapacityExceeded, Unavailable
from mesh.frames import ErrorInfo, Frame, FrameResult, SegmentKind, SegmentResult
from stage.frontend.engine_core import EngineCore
from stage.frontend.engine_types import EngineLimits, PipelineInfo


def test_requests_in_one_step_get_the_tokens_they_get_alone() -> None:
    prompts = {f"r{i}": tuple(range(i + 1, i + 4 + i)) for i in range(5)}
    core, _ = core_with()
    pipe = FakePipeline()
    for rid, prompt in prompts.items():
        core.add(request(rid, prompt, max_new=7))
    got = run_to_end(core, pipe)
    for rid, prompt in prompts.items():
        assert got[rid][0] == greedy(prompt, 7) and got[rid][1] == "length"
    # The first step prefills every prompt at once; then each step decodes every request.
    assert {s.kind for s in pipe.frames[0].segments} == {SegmentKind.PREFILL}
    assert len(pipe.frames[1].segments) == 5
    assert pipe.frames[-1].segments[-1].kind is SegmentKind.END
    assert not core.running and not pipe.sessions


def test_decode_goes_first_and_a_long_prompt_is_chunked_within_the_step_budget() -> None:
    core, _ = core_with(step_tokens=16, prefill_chunk_tokens=16)
    pipe = FakePipeline()
    core.add(request("short", (1, 2, 3), max_new=20))
    core.on_result(pipe.answer(core.next_frame()))
    long_prompt = tuple(range(1, 41))
    core.add(request("long", long_prompt, max_new=3))
    frames, long_tokens = [], []
    while len(frames) < 4 and (frame := core.next_frame()) is not None:
        frames.append(frame)
        for outcome in core.on_result(pipe.answer(frame)):
            if outcome.request_id == "long":
                long_tokens.extend(outcome.event.token_ids)
    for frame in frames:
        kinds = [s.kind for s in frame.segments]
        assert kinds[0] is SegmentKind.DECODE  # the running request's token first
        assert frame.row_count <= 16
    chunks = [s for f in frames for s in f.segments if s.session_id == "long"]
    assert [(c.pos_start, c.token_count) for c in chunks[:3]] == [(0, 15), (15, 15), (30, 10)]
    assert [c.sample for c in chunks[:3]] == [False, False, True]
    rest = run_to_end(core, pipe)
    assert long_tokens + rest.get("long", [[]])[0] == greedy(long_prompt, 3)


class TrueDrafter:
    """Drafts the fake model's own continuation: every draft is accepted."""

    cost_per_token_s = 0.0

    def __init__(self, prompt: tuple[int, ...]) -> None:
        self.tokens = list(prompt)

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def accept(self, accepted, token, proposal):
        self.tokens.extend([*proposal[:accepted], token])

    def propose(self, k):
        tokens = list(self.tokens)
        for _ in range(k):
            tokens.append(next_token(tokens))
        return tokens[len(self.tokens) :]


class WindowOf8:
    def next_window(self, state):
        return 8

    def observe(self, *args):
        pass


def test_speculation_windows_share_the_step_draft_budget() -> None:
    from mesh.speculative import Telemetry  # noqa: F401 - RequestRun builds one

    clock = Clock()
    core = EngineCore(
        EngineLimits(draft_tokens=12),
        clock,
        lambda req: (TrueDrafter(req.prompt_tokens), WindowOf8(), "fake"),
    )
    core.set_pipeline(PipelineInfo(term=1, stage_count=1))
    pipe = FakePipeline()
    prompts = {f"r{i}": (i + 1, i + 2) for i in range(3)}
    for rid, prompt in prompts.items():
        core.add(request(rid, prompt, max_new=30))
    got = run_to_end(core, pipe)
    for rid, prompt in prompts.items():
        assert got[rid][0] == greedy(prompt, 30)
    verify = [s for f in pipe.frames for s in f.segments if s.kind is SegmentKind.VERIFY]
    assert verify and max(s.token_count - 1 for s in verify) == 4  # 12 draft rows / 3


def test_a_window_drafts_nothing_past_a_stop_token() -> None:
    prompt = (5, 6, 7)
    stop_at = greedy(prompt, 12)[5]
    core = EngineCore(
        EngineLimits(), Clock(), lambda req: (TrueDrafter(req.prompt_tokens), WindowOf8(), "fake")
    )
    core.set_pipeline(PipelineInfo(term=1, stage_count=1))
    pipe = FakePipeline()
    core.add(request("s", prompt, max_new=12, stop={stop_at}))
    got = run_to_end(core, pipe)
    expected = greedy(prompt, 12)
    assert got["s"] == [expected[: expected.index(stop_at)], "stop", None]
    (window,) = [s for f in pipe.frames for s in f.segments if s.kind is SegmentKind.VERIFY]
    # The first decode step drafts the continuation up to the stop token, not past it.
    assert window.token_ids[-1] == stop_at and stop_at not in window.token_ids[:-1]


def test_admission_queues_then_refuses() -> None:
    core, _ = core_with(max_sessions=2, max_queued=1)
    for rid in ("a", "b", "c"):
        core.add(request(rid, (1, 2)))
    assert sorted(core.running) == ["a", "b"] and core.queued == 1
    with pytest.raises(CapacityExceeded, match="retry shortly"):
        core.add(request("d", (1, 2)))
    got = run_to_end(core, FakePipeline())
    assert sorted(got) == ["a", "b", "c"]


def test_a_tenant_with_fewer_running_is_admitted_before_another_s_burst() -> None:
    core, _ = core_with(max_sessions=2, max_queued=8)
    for index in range(5):  # alice's burst: 2 running, 3 waiting
        core.add(replace(request(f"alice-{index}", (1, 2, index)), tenant="alice"))
    core.add(replace(request("bob-0", (3, 4)), tenant="bob"))
    assert sorted(core.running) == ["alice-0", "alice-1"]
    core.cancel("alice-0")
    # bob runs nothing, alice one: bob's request goes first, not alice's next.
    assert sorted(core.running) == ["alice-1", "bob-0"]
    core.cancel("alice-1")
    core.cancel("bob-0")
    # Within a tenant, arrival order.
    assert sorted(core.running) == ["alice-2", "alice-3"]
    # Without keys every request is the tenant "": first come, first served.
    plain, _ = core_with(max_sessions=1, max_queued=8)
    for rid in ("a", "b", "c"):
        plain.add(request(rid, (1, 2)))
    plain.cancel("a")
    assert list(plain.running) == ["b"]


def test_stop_token_and_cancellation_end_the_session_everywhere() -> None:
    prompt = (5, 6, 7)
    stop_at = greedy(prompt, 4)[2]
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(request("s", prompt, max_new=10, stop={stop_at}))
    core.add(request("c", (9, 9), max_new=50))
    (first, _) = core.on_result(pipe.answer(core.next_frame()))
    core.cancel("c")
    got = run_to_end(core, pipe)
    assert got["s"][1] == "stop"
    expected = greedy(prompt, 4)
    assert list(first.event.token_ids) + got["s"][0] == expected[: expected.index(stop_at)]
    ends = [s.session_id for f in pipe.frames for s in f.segments if s.kind is SegmentKind.END]
    assert sorted(ends) == ["c", "s"] and not pipe.sessions


def test_frames_in_flight_stop_at_the_stage_count() -> None:
    core, _ = core_with(stage_count=2)
    pipe = FakePipeline()
    for rid in ("a", "b", "c"):
        core.add(request(rid, (1, 2, 3), max_new=5))
    first = core.next_frame()
    assert first is not None and len(first.segments) == 3
    assert core.next_frame() is None  # every request has its segment in flight
    core.on_result(pipe.answer(first))
    second = core.next_frame()
    assert second is not None


@pytest.mark.parametrize("streams", [8, 5])
def test_decoding_requests_split_evenly_over_the_frames_in_the_pipe(streams: int) -> None:
    """With 2 stages, the decode segments of the running requests go out as 2 frames
    of about half of them each, whatever order they became ready in, and every
    request is in one of any 2 frames in a row (none is left out twice)."""
    core, _ = core_with(stage_count=2)
    pipe = FakePipeline()
    prompts = {f"r{i}": (i + 1, i + 2, i + 3) for i in range(streams)}
    for rid, prompt in prompts.items():
        core.add(request(rid, prompt, max_new=12))
    got = run_pipelined(core, pipe)
    for rid, prompt in prompts.items():
        assert got[rid][0] == greedy(prompt, 12)
    decoding = [
        frame
        for frame in pipe.frames
        if frame.segments and all(s.kind is SegmentKind.DECODE for s in frame.segments)
    ]
    assert len(decoding) >= 10
    assert {len(f.segments) for f in decoding} <= {streams // 2, (streams + 1) // 2}
    for first, second in zip(decoding, decoding[1:], strict=False):
        assert {s.session_id for s in first.segments + second.segments} == set(prompts)


def test_stale_answers_are_dropped() -> None:
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(request("a", (1, 2, 3), max_new=4))
    frame = core.next_frame()
    good = pipe.answer(frame)
    older = FrameResult(0, frame.frame_id, good.results)
    moved = SegmentResult("a", "a", 9, (1,))
    assert core.on_result(older) == []
    assert core.on_result(FrameResult(1, frame.frame_id, (moved,))) == []
    assert core.stale == ["term", "position"]
    outcomes = core.on_result(good)
    assert [o.event.token_ids for o in outcomes] == [tuple(greedy((1, 2, 3), 1))]


def three_steps(core: EngineCore, pipe: FakePipeline, prompt: tuple[int, ...]) -> list[int]:
    """Request "r" (8 new tokens of ``prompt``) through three answered steps; the
    tokens it committed."""
    core.add(request("r", prompt, max_new=8))
    committed: list[int] = []
    for _ in range(3):
        for outcome in core.on_result(pipe.answer(core.next_frame())):
            committed.extend(outcome.event.token_ids)
    return committed


def finish_by_re_reading(
    core: EngineCore, pipe: FakePipeline, prompt: tuple[int, ...], committed: list[int]
) -> None:
    """Request "r"'s next frame reads all its tokens again from position 0, and it
    ends with the tokens it gets alone."""
    resend = core.next_frame()
    (segment,) = resend.segments
    assert segment.kind is SegmentKind.PREFILL and segment.pos_start == 0
    assert segment.token_ids == prompt + tuple(committed)
    for outcome in core.on_result(pipe.answer(resend)):
        committed.extend(outcome.event.token_ids)
    rest = run_to_end(core, pipe)
    assert committed + rest["r"][0] == greedy(prompt, 8)


def test_a_lost_pipeline_is_recovered_by_re_reading_every_token() -> None:
    prompt = (3, 1, 4, 1, 5)
    core, clock = core_with(recovery_timeout_s=30)
    pipe = FakePipeline()
    committed = three_steps(core, pipe, prompt)
    lost = core.next_frame()  # sent, never answered: the stage died
    assert core.set_pipeline(None) == []
    assert core.next_frame() is None
    unavailable = ErrorInfo("UNAVAILABLE", "stage 1 is gone")
    late = FrameResult(1, lost.frame_id, (SegmentResult("r", "r", 0, error=unavailable),))
    assert core.on_result(late) == []
    pipe.sessions.clear()  # the new pipeline holds nothing
    clock.now += 5
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    finish_by_re_reading(core, pipe, prompt, committed)
    assert core.recoveries == 1


def test_a_pipeline_that_answers_after_the_round_timeout_is_read_again_on_its_term() -> None:
    """A stage hangs past the round timeout (no coordinator replaces the pipeline)
    and wakes: its late answer shows the pipeline moves again, and the request that
    lost its frame to the timeout reads its tokens again on the same term (the late
    answer itself is void) instead of failing when its recovery deadline passes."""
    prompt = (2, 7, 1, 8)
    core, clock = core_with(round_timeout_s=20, recovery_timeout_s=60)
    pipe = FakePipeline()
    committed = three_steps(core, pipe, prompt)
    hung = core.next_frame()
    clock.now += 21
    assert core.expire() == []
    assert core.unanswered_term == 1 and not core.frames
    assert core.next_frame() is None  # it waits for a pipeline
    assert core.on_result(pipe.answer(hung)) == []
    assert core.unanswered_term == 0 and core.recoveries == 1 and core.stale == ["epoch"]
    finish_by_re_reading(core, pipe, prompt, committed)


def test_a_return_link_opened_again_gives_up_the_frames_it_had_finished() -> None:
    """A stage's Return link broke and it opened it again on the same term (no
    coordinator acted), having finished frames up to ``answered_upto``: the answers
    of those still waiting went with the old link, so they are given up at once
    (kept, they would hold the term "unanswered" past the round timeout) and their
    request reads its tokens again; a late answer of the old frame is void. A frame
    sent after them is answered on the new link and stays."""
    prompt = (6, 2, 8, 3)
    core, _ = core_with(round_timeout_s=20, recovery_timeout_s=60)
    pipe = FakePipeline()
    committed = three_steps(core, pipe, prompt)
    in_pipe = core.next_frame()
    core.add(request("q", (5, 5), max_new=2))
    later = core.next_frame()
    assert later is not None and later.frame_id > in_pipe.frame_id
    core.links_reopened(1, "a stage opened its return link again", in_pipe.frame_id)
    assert list(core.frames) == [later.frame_id] and core.recoveries == 1
    assert core.on_result(pipe.answer(in_pipe)) == [] and core.stale == ["epoch"]
    first: dict[str, list] = {}
    collect(first, core.on_result(pipe.answer(later)))
    rest = run_to_end(core, pipe)
    assert committed + rest["r"][0] == greedy(prompt, 8)
    assert first["q"][0] + rest["q"][0] == greedy((5, 5), 2)


def test_a_forward_link_opened_again_reads_the_requests_it_failed_again() -> None:
    """Stage 0's Forward link broke (its segments failed UNAVAILABLE). A note of a
    Return link opened again while stage 0's own link is still broken resumes
    nothing (``resume`` False: a re-read would only fail again); once stage 0's link
    is open again the request reads its tokens again on the same term instead of
    waiting for a pipeline only a coordinator could load. A link of another term
    changes nothing."""
    prompt = (9, 4, 4)
    core, _ = core_with(recovery_timeout_s=60)
    pipe = FakePipeline()
    committed = three_steps(core, pipe, prompt)
    core.next_frame()
    # The break fails the sessions stage 0 holds, in an answer that names no frame:
    # the frame they were in waits on nothing any more (else the local stall rule
    # would count it as waiting after the link is whole again).
    unavailable = ErrorInfo("UNAVAILABLE", "stage 1 is unreachable from stage 0")
    refusal = FrameResult(1, 0, (SegmentResult("r", "r", 0, error=unavailable),))
    assert core.on_result(refusal) == []
    assert core.next_frame() is None  # waiting for the pipeline
    assert not core.frames and core.oldest_unanswered() is None
    core.links_reopened(1, "a stage opened its return link again", 99, resume=False)
    core.links_reopened(2, "a link of another term")
    assert core.next_frame() is None and core.recoveries == 0
    core.links_reopened(1, "stage 0 opened its forward link again")
    assert core.recoveries == 1
    finish_by_re_reading(core, pipe, prompt, committed)


def _an_end_beside_a_decode(**limits) -> tuple[EngineCore, Frame]:
    """A 2-stage core where request "a" ended after its prompt and "b" decodes: the
    frame just sent holds a's END and b's decode."""
    core, _ = core_with(stage_count=2, **limits)
    core.add(request("a", (5, 6), max_new=1))
    core.add(request("b", (7, 8), max_new=20))
    collect({}, core.on_result(FakePipeline().answer(core.next_frame())))
    return core, core.next_frame()


def test_the_end_of_a_finished_request_in_a_frame_lost_to_a_break_waits_for_nothing() -> None:
    """A request ends and its END goes in the next frame with another request's
    decode; a break loses that frame. The stage fails the decode but not the END (no
    request waits on an END): the frame is over once the other request is lost. A
    frame of ENDs alone is not tracked at all. Before, either stayed "waiting": the
    local stall rule held /health at 503 while nothing was stuck, and at its round
    timeout the term counted as unanswered, which held new requests back for good
    while nothing ran (found on namespace hosts: one reset of a link between two
    workers while a request had just ended)."""
    core, lost = _an_end_beside_a_decode(recovery_timeout_s=60)
    kinds = {s.session_id: s.kind for s in lost.segments}
    assert kinds == {"a": SegmentKind.END, "b": SegmentKind.DECODE}
    unavailable = ErrorInfo("UNAVAILABLE", "stage 2 is unreachable from stage 1")
    assert core.on_result(FrameResult(1, 0, (SegmentResult("b", "b", 0, error=unavailable),))) == []
    assert lost.frame_id not in core.frames and core.oldest_unanswered() is None
    # The same when the failure names the frame (a stage that could not run it).
    core, lost = _an_end_beside_a_decode(recovery_timeout_s=0)
    failed = FrameResult(1, lost.frame_id, (SegmentResult("b", "b", 2, error=unavailable),))
    core.on_result(failed)
    assert lost.frame_id not in core.frames and core.oldest_unanswered() is None
    # A frame of ENDs alone.
    core, _ = core_with(stage_count=2)
    core.add(request("c", (1, 2), max_new=20))
    core.on_result(FakePipeline().answer(core.next_frame()))
    core.next_frame()
    core.cancel("c")
    ends = core.next_frame()
    assert ends is not None and {s.kind for s in ends.segments} == {SegmentKind.END}
    assert ends.frame_id not in core.frames


def test_an_unanswered_term_is_forgotten_when_a_new_pipeline_loads() -> None:
    core, clock = core_with(round_timeout_s=20, recovery_timeout_s=60)
    pipe = FakePipeline()
    core.add(request("r", (1, 2), max_new=8))
    core.on_result(pipe.answer(core.next_frame()))
    core.next_frame()
    clock.now += 21
    core.expire()
    assert core.unanswered_term == 1
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    assert core.unanswered_term == 0


def test_recovery_gives_up_after_its_deadline() -> None:
    core, clock = core_with(recovery_timeout_s=10)
    pipe = FakePipeline()
    core.add(request("r", (1, 2), max_new=8))
    core.on_result(pipe.answer(core.next_frame()))
    core.next_frame()
    core.set_pipeline(None)
    clock.now += 11
    (outcome,) = core.expire()
    assert isinstance(outcome.error, Unavailable) and "did not recover" in outcome.error.message
    assert not core.running


def test_a_segment_error_fails_only_its_request() -> None:
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(request("bad", (1, 2), max_new=3))
    core.add(request("good", (3, 4), max_new=3))
    frame = core.next_frame()
    answer = pipe.answer(frame)
    refused = SegmentResult("bad", "bad", 0, error=ErrorInfo("INVALID_ARGUMENT", "too long"))
    outcomes = core.on_result(FrameResult(1, frame.frame_id, (refused, answer.results[1])))
    assert [o.request_id for o in outcomes] == ["bad", "good"]
    assert outcomes[0].error is not None and "too long" in outcomes[0].error.message
    got = run_to_end(core, pipe)
    assert got["good"][0] == greedy((3, 4), 3)[1:]


def test_the_coordinator_sets_the_step_budget() -> None:
    core, _ = core_with(step_tokens=512)
    core.set_pipeline(PipelineInfo(term=1, stage_count=1, step_tokens=8))
    pipe = FakePipeline()
    core.add(request("long", tuple(range(1, 21)), max_new=2))
    frame = core.next_frame()
    assert frame.row_count == 8 and not frame.segments[0].sample
    assert run_to_end(core, pipe) == {}  # the frame above was never answered


# ---- the prefix cache ---------------------------------------------------------------


def first_prefill(pipe: FakePipeline, rid: str):
    return next(
        s
        for f in pipe.frames
        for s in f.segments
        if s.request_id == rid and s.kind is SegmentKind.PREFILL
    )


def test_a_later_prompt_starts_from_the_kept_prefix_and_gets_the_same_tokens() -> None:
    core, _ = core_with(prefix_cache_tokens=1000, prefill_chunk_tokens=16)
    pipe = FakePipeline()
    history = tuple(range(1, 60))
    core.add(request("turn1", history, max_new=8))
    first = run_to_end(core, pipe)["turn1"][0]
    # The session's positions are kept: the prompt and all output but the last token.
    assert pipe.kept == {"turn1": [*history, *first[:-1]]}
    turn2 = (*history, *first, 5, 6, 7)
    core.add(request("turn2", turn2, max_new=8))
    got = run_to_end(core, pipe)["turn2"]
    assert got[0] == greedy(turn2, 8)
    segment = first_prefill(pipe, "turn2")
    assert segment.prefix_from == "turn1"
    assert segment.pos_start == len(history) + len(first) - 1
    assert segment.sampling is not None  # the session's first segment
    assert core.prefix_hits == 1 and core.cached_tokens_total == segment.pos_start
    # turn2 extends turn1: turn1 is forgotten, turn2 kept.
    assert set(pipe.kept) == {"turn2"} and set(core.prefixes._entries) == {"turn2"}


def test_cached_tokens_are_reported_in_the_stats() -> None:
    core, _ = core_with(prefix_cache_tokens=1000)
    pipe = FakePipeline()
    prompt = tuple(range(1, 40))
    core.add(request("a", prompt, max_new=3))
    run_to_end(core, pipe)
    run = core.add(request("b", (*prompt[:35], 90, 91), max_new=3))
    run_to_end(core, pipe)
    assert run.stats().cached_tokens == 35


def test_a_prefix_a_stage_lost_is_read_again_from_position_0() -> None:
    core, _ = core_with(
        stage_count=3, prefix_cache_tokens=1000, prefill_chunk_tokens=8, step_tokens=8
    )
    pipe = FakePipeline()
    history = tuple(range(1, 50))
    core.add(request("turn1", history, max_new=4))
    first = run_pipelined(core, pipe)["turn1"][0]
    pipe.lost.add("turn1")
    turn2 = (*history, *first, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)
    core.add(request("turn2", turn2, max_new=6))
    got = run_pipelined(core, pipe)["turn2"]
    assert got[0] == greedy(turn2, 6) and got[2] is None
    prefills = [
        s
        for f in pipe.frames
        for s in f.segments
        if s.request_id == "turn2" and s.kind is SegmentKind.PREFILL
    ]
    assert prefills[0].prefix_from == "turn1" and prefills[0].epoch == 0
    again = [s for s in prefills if s.epoch == 1]
    assert again[0].pos_start == 0 and not again[0].prefix_from
    assert again[0].sampling is not None
    assert core.prefix_lost == 1 and "turn1" not in core.prefixes
    assert core.stale  # the void chunks' answers were dropped


@pytest.mark.parametrize(("idle", "offered"), [(200.0, True), (290.0, False)])
def test_a_prefix_the_stages_dropped_as_idle_is_not_offered(idle: float, offered: bool) -> None:
    """The stages drop a kept prefix unused for their session idle timeout (300 s
    here); stage 0 forgets it a little before (0.9 of it), so a prompt after a quiet
    spell is read whole at once instead of being refused by a stage first."""
    core, clock = core_with(prefix_cache_tokens=1000)
    core.set_pipeline(PipelineInfo(term=1, stage_count=1, session_idle_s=300.0))
    pipe = FakePipeline()
    history = tuple(range(1, 60))
    core.add(request("turn1", history, max_new=4))
    first = run_to_end(core, pipe)["turn1"][0]
    clock.now += idle
    turn2 = (*history, *first, 5, 6, 7)
    core.add(request("turn2", turn2, max_new=4))
    assert run_to_end(core, pipe)["turn2"][0] == greedy(turn2, 4)
    assert bool(first_prefill(pipe, "turn2").prefix_from) is offered
    assert core.prefix_lost == 0 and core.prefix_hits == int(offered)


def test_the_least_recently_used_prefixes_go_first_and_the_stages_are_told() -> None:
    core, _ = core_with(prefix_cache_tokens=100)
    pipe = FakePipeline()
    for i in range(4):
        core.add(request(f"r{i}", tuple(range(100 * i + 1, 100 * i + 41)), max_new=2))
        run_to_end(core, pipe)
    # 41 positions each: two fit in 100.
    assert set(core.prefixes._entries) == {"r2", "r3"}
    assert set(pipe.kept) == {"r2", "r3"}


def test_a_failed_request_keeps_nothing_and_a_new_pipeline_forgets_everything() -> None:
    core, _ = core_with(prefix_cache_tokens=1000)
    pipe = FakePipeline()
    core.add(request("a", tuple(range(1, 40)), max_new=2))
    run_to_end(core, pipe)
    assert "a" in core.prefixes
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    assert len(core.prefixes) == 0
    core.add(request("b", tuple(range(1, 45)), max_new=2))
    run_to_end(core, pipe)
    assert not first_prefill(pipe, "b").prefix_from


def test_the_prefix_cache_can_be_off() -> None:
    core, _ = core_with(prefix_cache_tokens=0)
    pipe = FakePipeline()
    core.add(request("a", tuple(range(1, 40)), max_new=2))
    run_to_end(core, pipe)
    core.add(request("b", tuple(range(1, 45)), max_new=2))
    run_to_end(core, pipe)
    assert not pipe.kept and not first_prefill(pipe, "b").prefix_from


# ---- n > 1: choices forked from the first one's session ----------------------------


def prefills_of(pipe: FakePipeline, rid: str) -> list[tuple[int, object]]:
    return [
        (f.frame_id, s)
        for f in pipe.frames
        for s in f.segments
        if s.request_id == rid and s.kind is SegmentKind.PREFILL
    ]


@pytest.mark.parametrize("stage_count", [1, 3])
def test_choices_start_from_a_copy_of_the_first_choice_prompt(stage_count: int) -> None:
    core, _ = core_with(stage_count=stage_count, prefill_chunk_tokens=16, step_tokens=16)
    pipe = FakePipeline()
    prompt = tuple(range(3, 50))
    runs = [core.add(request("q", prompt, max_new=5))]
    runs += [core.add(request(f"q-{i}", prompt, max_new=5, fork_of="q")) for i in (1, 2)]
    got = run_pipelined(core, pipe)
    for rid in ("q", "q-1", "q-2"):
        assert got[rid][0] == greedy(prompt, 5) and got[rid][2] is None
    last_prompt_frame = prefills_of(pipe, "q")[-1][0]
    for rid in ("q-1", "q-2"):
        (frame_id, segment), *rest = prefills_of(pipe, rid)
        # One prefill of the prompt's last token, from the first choice's session,
        # sent after every chunk of its prompt.
        assert not rest and frame_id > last_prompt_frame
        assert segment.prefix_from == "q" and segment.pos_start == len(prompt) - 1
        assert segment.token_ids == prompt[-1:] and segment.sampling is not None
    assert [run.stats().cached_tokens for run in runs] == [0, len(prompt) - 1, len(prompt) - 1]


def test_a_choice_whose_first_choice_is_gone_reads_its_prompt() -> None:
    core, _ = core_with(prefix_cache_tokens=0)
    pipe = FakePipeline()
    prompt = tuple(range(3, 30))
    core.add(request("q", prompt, max_new=2))
    run_to_end(core, pipe)
    core.add(request("q-1", prompt, max_new=4, fork_of="q"))
    assert run_to_end(core, pipe)["q-1"][0] == greedy(prompt, 4)
    (_, segment), *_ = prefills_of(pipe, "q-1")
    assert segment.pos_start == 0 and not segment.prefix_from


def test_a_choice_a_stage_cannot_fork_reads_its_prompt_again() -> None:
    core, _ = core_with(stage_count=2)
    pipe = FakePipeline()
    pipe.lost.add("q")
    prompt = tuple(range(3, 30))
    core.add(request("q", prompt, max_new=4))
    core.add(request("q-1", prompt, max_new=4, fork_of="q"))
    got = run_pipelined(core, pipe)
    assert got["q-1"][0] == greedy(prompt, 4) and got["q-1"][2] is None
    segments = [s for _, s in prefills_of(pipe, "q-1")]
    assert segments[0].prefix_from == "q"
    assert segments[-1].pos_start == 0 and segments[-1].epoch == 1


def _full_pipe(prompts_ahead: bool = True):
    """Two stages, four requests decoding: both frames of the pipe in flight."""
    core, _ = core_with(stage_count=2, prompts_ahead=prompts_ahead)
    pipe = FakePipeline()
    for rid in ("a", "b", "c", "d"):
        core.add(request(rid, (1, 2, 3, ord(rid)), max_new=6))
    got: dict[str, list] = {}
    collect(got, core.on_result(pipe.answer(core.next_frame())))  # the four prompts
    in_flight = [core.next_frame(), core.next_frame()]
    assert all(f is not None for f in in_flight)
    return core, pipe, got, in_flight


def test_new_prompts_go_in_a_frame_of_their_own_when_the_pipe_is_full() -> None:
    core, pipe, got, in_flight = _full_pipe()
    core.add(request("n1", (7, 7, 7), max_new=6))
    ahead = core.next_frame()
    assert ahead is not None
    assert [(s.session_id, s.kind) for s in ahead.segments] == [("n1", SegmentKind.PREFILL)]
    # One such frame at a time; later prompts join it while stage 0 has not started it.
    core.add(request("n2", (8, 9), max_new=6))
    assert core.next_frame() is None
    assert core.open_prompts_frame() == ahead.frame_id
    joined = core.join_prompts_frame(ahead.frame_id)
    assert [s.session_id for s in joined] == ["n2"]
    assert core.open_prompts_frame() == 0  # nobody else waits
    amended = replace(ahead, segments=ahead.segments + tuple(joined))
    got = _finish(core, pipe, got, [*in_flight, amended])
    expected = {rid: (1, 2, 3, ord(rid)) for rid in "abcd"} | {"n1": (7, 7, 7), "n2": (8, 9)}
    for rid, prompt in expected.items():
        assert got[rid][0] == greedy(prompt, 6) and got[rid][1] == "length", rid
    assert not core.running and not core.frames


def test_a_started_prompts_frame_takes_no_more_and_later_prompts_wait_their_turn() -> None:
    core, pipe, got, in_flight = _full_pipe()
    core.add(request("n1", (7, 7, 7), max_new=3))
    ahead = core.next_frame()
    core.add(request("n2", (8, 9), max_new=3))
    # Stage 0 had started the frame: the caller does not join it, n2 goes later.
    for frame in [*in_flight, ahead]:
        collect(got, core.on_result(pipe.answer(frame)))
    rest = run_pipelined(core, pipe)
    assert rest["n2"][0] == greedy((8, 9), 3)
    assert got["n1"][0] + rest["n1"][0] == greedy((7, 7, 7), 3)


def test_prompts_wait_for_a_free_frame_when_prompts_ahead_is_off() -> None:
    core, _, _, _ = _full_pipe(prompts_ahead=False)
    core.add(request("n1", (7, 7, 7), max_new=6))
    assert core.next_frame() is None
    assert core.open_prompts_frame() == 0


def _finish(core, pipe, got, frames) -> dict[str, list]:
    """Answer ``frames`` in order, then run the core to the end; every request's
    tokens, finish and error."""
    for frame in frames:
        collect(got, core.on_result(pipe.answer(frame)))
    for rid, entry in run_pipelined(core, pipe).items():
        got.setdefault(rid, [[], None, None])
        got[rid][0].extend(entry[0])
        got[rid][1], got[rid][2] = entry[1], entry[2] or got[rid][2]
    return got


def test_a_prompt_cancelled_in_an_unstarted_frame_leaves_no_session_behind() -> None:
    """A new request cancelled while its prompt waits in a frame of new prompts that
    stage 0 has not started, then another prompt arrives: the cancelled one's END
    does not join that frame (it would run before the prompt and leave the session
    the prompt opens on every stage); it goes in a later frame."""
    core, pipe, got, in_flight = _full_pipe()
    core.add(request("n1", (7, 7, 7), max_new=6))
    ahead = core.next_frame()
    assert ahead is not None
    core.cancel("n1")
    core.add(request("n2", (8, 9), max_new=6))
    assert core.open_prompts_frame() == 0
    assert core.join_prompts_frame(ahead.frame_id) == []
    got = _finish(core, pipe, got, [*in_flight, ahead])
    assert got["n2"][0] == greedy((8, 9), 6) and got["n2"][1] == "length"
    assert not pipe.sessions and not core.running and not core.frames


def test_no_end_joins_a_frame_whose_new_session_copies_that_session() -> None:
    """A second choice (n=2) copies its first choice's prompt in a frame of new
    prompts; the first choice is cancelled and a new prompt arrives before stage 0
    starts that frame: the first choice's END stays out of it (a stage applies ENDs
    before the rows, so the copy would find nothing and the choice would read its
    whole prompt again)."""
    core, _ = core_with(stage_count=2)
    pipe = FakePipeline()
    core.add(request("a", (1, 2, 3), max_new=4))
    first = core.next_frame()
    prompt = (5, 6, 7, 8, 9)
    core.add(request("p", prompt, max_new=4))
    core.add(request("p-1", prompt, max_new=4, fork_of="p"))
    second = core.next_frame()  # p's prompt; p-1 waits for it to be sent
    assert [s.session_id for s in second.segments] == ["p"]
    ahead = core.next_frame()  # the pipe is full: p-1 copies p in a frame of its own
    assert [(s.session_id, s.prefix_from) for s in ahead.segments] == [("p-1", "p")]
    core.cancel("p")
    core.add(request("n", (4, 4), max_new=4))
    assert core.open_prompts_frame() == 0
    got = _finish(core, pipe, {}, [first, second, ahead])
    assert not pipe.refused
    assert got["p-1"][0] == greedy(prompt, 4) and got["n"][0] == greedy((4, 4), 4)
    assert not pipe.sessions and not core.running and not core.frames


@pytest.mark.parametrize("step_tokens", [2, 3, 64])
@pytest.mark.parametrize("prompts_ahead", [True, False])
def test_requests_come_and_go_and_no_stage_holds_more_sessions_than_it_may(
    prompts_ahead: bool, step_tokens: int
) -> None:
    """Requests arrive in waves and some are cancelled mid-way (clients gone, stop
    strings) while the pipe is full and others wait for a slot: no stage is ever
    asked to hold more sessions than the engine runs, every request that was not
    cancelled gets its own tokens, and nothing is left on the stages."""
    core, _ = core_with(
        stage_count=2,
        max_sessions=4,
        max_queued=16,
        prompts_ahead=prompts_ahead,
        step_tokens=step_tokens,
        prefix_cache_tokens=0,
    )
    pipe = FakePipeline(capacity=4)
    prompts = {f"r{i}": (3, i, i + 1, 2 * i) for i in range(14)}
    lengths = {rid: 4 + (i * 5) % 9 for i, rid in enumerate(prompts)}
    arrivals: dict[int, list] = {0: [], 3: [], 7: [], 12: []}
    for i, (rid, prompt) in enumerate(prompts.items()):
        arrivals[(0, 3, 7, 12)[i % 4]].append(request(rid, prompt, max_new=lengths[rid]))
    cancels = {5: ["r0"], 9: ["r4", "r1"], 16: ["r2"]}
    got = run_streaming(core, pipe, arrivals, cancels)
    for rid, prompt in prompts.items():
        tokens, finish, error = got[rid]
        assert error is None, (rid, error)
        if finish != "cancelled":
            assert tokens == greedy(prompt, lengths[rid]) and finish == "length", rid
    assert sum(got[rid][1] == "cancelled" for rid in prompts) >= 3
    assert not pipe.sessions and not core.running and not core.frames


PROMPTS = {rid: (*range(1, 40), ord(rid)) for rid in "abcd"} | {"n": (*range(1, 40), 97, 5)}


def _four_decoding_with_the_pipe_full(**limits):
    """Two stages holding 4 sessions each, 4 requests decoding, both frames of the
    pipe in flight, a fifth request queued."""
    core, _ = core_with(stage_count=2, max_sessions=4, **limits)
    pipe = FakePipeline(capacity=4)
    got: dict[str, list] = {}
    for rid in "abcd":
        core.add(request(rid, PROMPTS[rid], max_new=8))
    while any(t.prefilling for t in core.running.values()):
        collect(got, core.on_result(pipe.answer(core.next_frame())))
    in_flight = [core.next_frame(), core.next_frame()]
    assert all(f is not None for f in in_flight)
    core.add(request("n", PROMPTS["n"], max_new=6))
    assert core.queued == 1
    return core, pipe, got, in_flight


@pytest.mark.parametrize("prefix_cache_tokens", [0, 4096])
def test_a_request_cancelled_with_the_pipe_full_is_ended_before_its_slot_is_reused(
    prefix_cache_tokens: int,
) -> None:
    """A client goes away (or a stop string ends a request) while both frames are in
    flight: the queued request takes its slot, and the frame of new prompts that
    carries its prompt carries the END first, so that no stage holds more sessions
    than it may (and a prompt that starts from the ended request's kept prefix finds
    it)."""
    core, pipe, got, in_flight = _four_decoding_with_the_pipe_full(
        prefix_cache_tokens=prefix_cache_tokens
    )
    core.cancel("a")
    assert "n" in core.running
    ahead = core.next_frame()
    assert ahead is not None
    kinds = [(s.session_id, s.kind) for s in ahead.segments]
    assert kinds == [("a", SegmentKind.END), ("n", SegmentKind.PREFILL)]
    if prefix_cache_tokens:
        assert ahead.segments[0].keep_prefix and ahead.segments[1].prefix_from == "a"
    for frame in [*in_flight, ahead]:
        collect(got, core.on_result(pipe.answer(frame)))
    got.pop("a")
    rest = run_pipelined(core, pipe)
    for rid, entry in rest.items():
        got.setdefault(rid, [[], None, None])
        got[rid][0].extend(entry[0])
        got[rid][1], got[rid][2] = entry[1], entry[2]
    assert got["n"][2] is None and got["n"][0] == greedy(PROMPTS["n"], 6)
    for rid in "bcd":
        assert got[rid][2] is None and got[rid][0] == greedy(PROMPTS[rid], 8), rid


def test_new_prompts_join_only_the_last_frame_sent() -> None:
    """A frame of new prompts that a later frame has overtaken in the sending order
    takes no more prompts: they would reach the stages before that frame's ENDs."""
    core, pipe, got, in_flight = _four_decoding_with_the_pipe_full(max_queued=4)
    core.cancel("a")
    ahead = core.next_frame()
    collect(got, core.on_result(pipe.answer(in_flight[0])))
    later = core.next_frame()  # a frame after the prompts frame
    assert later is not None
    core.add(request("m", (9, 9), max_new=3))
    core.cancel("b")  # m takes b's slot; b's END is not sent yet
    assert "m" in core.running
    assert core.open_prompts_frame() == 0
    for frame in [in_flight[1], ahead, later]:
        collect(got, core.on_result(pipe.answer(frame)))
    rest = run_pipelined(core, pipe)
    assert rest["m"][2] is None and rest["m"][0] == greedy((9, 9), 3)


def test_the_engine_runs_no_more_requests_than_the_stages_keep_sessions_for() -> None:
    core, _ = core_with(stage_count=2, max_sessions=8)
    core.set_pipeline(PipelineInfo(term=2, stage_count=2, kv_sessions=3))
    for rid in "abcde":
        core.add(request(rid, (1, ord(rid)), max_new=3))
    assert sorted(core.running) == ["a", "b", "c"] and core.queued == 2
    got = run_pipelined(core, FakePipeline(capacity=3))
    assert all(got[rid][2] is None for rid in "abcde")
    assert all(got[rid][0] == greedy((1, ord(rid)), 3) for rid in "abcde")


@pytest.mark.parametrize("prompts_ahead", [True, False])
@pytest.mark.parametrize("step_tokens", [3, 8, 64])
@pytest.mark.parametrize("prefix_cache_tokens", [0, 4096])
def test_second_choices_copy_their_first_choice_under_load(
    prompts_ahead: bool, step_tokens: int, prefix_cache_tokens: int
) -> None:
    """Requests with two choices (n=2) arrive in waves, queue for slots and some are
    cancelled: every second choice starts from a copy of its first choice's prompt
    that a stage can make (never in the frame that holds the last chunk of that
    prompt, whose rows have not run when the frame's new sessions copy), and gets
    the tokens of its first choice."""
    for seed in range(30):
        rng = random.Random(seed)
        core, _ = core_with(
            stage_count=2,
            max_sessions=4,
            max_queued=40,
            prompts_ahead=prompts_ahead,
            step_tokens=step_tokens,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        pipe = FakePipeline(capacity=4)
        arrivals: dict[int, list] = {}
        cancels: dict[int, list[str]] = {}
        expected = {}
        for i in range(10):
            prompt = (*[3, 4, 5, 6] * 5, i, i + 1)
            count, at = rng.choice([2, 5, 9]), rng.choice([0, 0, 2, 5, 9])
            arrivals.setdefault(at, []).append(request(f"p{i}", prompt, max_new=count))
            arrivals[at].append(request(f"p{i}-1", prompt, max_new=count, fork_of=f"p{i}"))
            expected[f"p{i}"] = expected[f"p{i}-1"] = greedy(prompt, count)
            if rng.random() < 0.3:
                cancels.setdefault(at + rng.choice([1, 3, 6]), []).append(f"p{i}")
        got = run_streaming(core, pipe, arrivals, cancels)
        assert not pipe.refused, (seed, pipe.refused)  # nobody had to read a prompt again
        for rid, tokens in expected.items():
            if got[rid][1] != "cancelled":
                assert got[rid][2] is None and got[rid][0] == tokens, (seed, rid)


def test_one_slow_round_does_not_stretch_the_stall_rule_for_long() -> None:
    """The "longest recent round" the stall deadline grows with is a high percentile
    of the rounds answered in the last two minutes: one round that took 25 s (a stage
    that hung and woke) neither counts once many short ones followed, nor once it is
    old (before, the longest of the last 64 rounds, however old)."""
    from stage.frontend.engine_core import ROUND_MAX_AGE_S

    core, clock = core_with()
    pipe = FakePipeline()
    core.add(request("a", (1, 2, 3), max_new=40))

    def round_of(seconds: float) -> None:
        frame = core.next_frame()
        clock.now += seconds
        core.on_result(pipe.answer(frame))

    round_of(25.0)
    assert core.long_round() == 25.0  # the only round seen: nothing else to go by
    for _ in range(19):
        round_of(0.05)
    assert core.long_round() == pytest.approx(0.05)
    # Slow rounds that keep coming are what rounds take now: they count.
    for _ in range(5):
        round_of(3.0)
    assert core.long_round() == 3.0
    clock.now += ROUND_MAX_AGE_S + 1
    assert core.long_round() == 0.0
    frame = core.next_frame()
    assert core.oldest_unanswered() == (frame.frame_id, clock.now, 0.0)


@pytest.mark.parametrize(("stall_ms", "cut"), [(250.0, True), (0.0, False)])
def test_a_long_prompt_is_cut_to_the_decode_stall_while_others_decode(
    stall_ms: float, cut: bool
) -> None:
    """Decode rows share a frame with a prompt chunk, and wait for it on every stage:
    while requests decode, the frame's rows are cut to what the measured prompt
    frames say costs about ``decode_stall_ms`` (here 10 ms + 2 ms a row: about 120
    rows in 250 ms, one of them the decoding request's). Alone, a prompt takes the
    step budget (a 512-row chunk); so it does with no stall limit (511 beside the
    decode row)."""
    core, _ = core_with(decode_stall_ms=stall_ms, prefix_cache_tokens=0)
    for rows in (64, 128, 256, 512, 100, 300):
        core.prompt_cost.observe(rows, 10.0 + 2.0 * rows)
    pipe = FakePipeline()
    core.add(request("alone", tuple(range(1, 90)) * 10, max_new=2))
    first = core.next_frame()
    assert [s.token_count for s in first.segments] == [512]
    core.on_result(pipe.answer(first))
    run_to_end(core, pipe)
    core.add(request("short", (7, 8, 9), max_new=50))
    core.on_result(pipe.answer(core.next_frame()))  # its prompt: it decodes now
    core.add(request("long", tuple(range(2, 91)) * 10, max_new=2))
    frame = core.next_frame()
    kinds = [s.kind for s in frame.segments]
    assert kinds == [SegmentKind.DECODE, SegmentKind.PREFILL]
    chunk = frame.segments[1].token_count
    assert 110 <= chunk <= 119 if cut else chunk == 512 - 1


@pytest.mark.parametrize("when", ["decoding", "reading its prompt"])
def test_a_session_a_stage_dropped_is_read_again_and_gives_the_same_tokens(when: str) -> None:
    """A stage that no longer holds a live request's session (its idle sweep, a stage
    that dropped it) answers NOT_FOUND: nothing the client did. The request reads its
    tokens again from 0 in a new epoch and ends with the tokens it gets alone."""
    prompt = tuple(range(1, 40))
    core, _ = core_with(prefill_chunk_tokens=8, step_tokens=8)
    pipe = FakePipeline()
    core.add(request("r", prompt, max_new=8))
    got: dict[str, list] = {}
    steps = 7 if when == "decoding" else 2
    for _ in range(steps):
        collect(got, core.on_result(pipe.answer(core.next_frame())))
    assert bool(got) == (when == "decoding")
    pipe.sessions.pop("r")
    rest = run_to_end(core, pipe)
    assert rest["r"][2] is None
    assert got.get("r", [[]])[0] + rest["r"][0] == greedy(prompt, 8)
    assert core.rereads == 1
    again = [s for f in pipe.frames for s in f.segments if s.epoch == 1]
    assert again[0].kind is SegmentKind.PREFILL and again[0].pos_start == 0


def test_a_stage_that_keeps_losing_a_session_fails_the_request_with_a_retry() -> None:
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(request("r", (1, 2, 3), max_new=50))
    out: dict[str, list] = {}
    for _ in range(60):
        frame = core.next_frame()
        if frame is None:
            break
        collect(out, core.on_result(pipe.answer(frame)))
        pipe.sessions.pop("r", None)
    error = out["r"][2]
    assert isinstance(error, Unavailable) and "retry the request" in error.message
    assert not core.running


def test_a_frame_that_comes_back_without_a_request_s_answer_does_not_hang_it() -> None:
    """Whatever drops the answer a request waits for (here a result at a position
    the request does not expect, dropped as stale), the request is read again at the
    next tick instead of waiting forever."""
    core, _ = core_with()
    pipe = FakePipeline()
    prompt = (5, 6, 7)
    core.add(request("r", prompt, max_new=6))
    got: dict[str, list] = {}
    collect(got, core.on_result(pipe.answer(core.next_frame())))
    frame = core.next_frame()
    (answer,) = pipe.answer(frame).results
    moved = replace(answer, pos_start=answer.pos_start + 5)
    assert core.on_result(FrameResult(1, frame.frame_id, (moved,))) == []
    assert core.stale == ["position"]
    assert core.next_frame() is None  # it waits...
    assert core.expire() == []  # ...until the tick sees its frame gone
    rest = run_to_end(core, pipe)
    assert got["r"][0] + rest["r"][0] == greedy(prompt, 6)
    assert core.rereads == 1


def test_a_prompt_left_waiting_behind_others_goes_first_before_its_session_idles() -> None:
    """Prompt chunks take a step's room in admission order, but a prompt whose session
    is open on the stages and has waited a third of their idle timeout goes first."""
    core, clock = core_with(prefill_chunk_tokens=8, step_tokens=8)
    core.set_pipeline(PipelineInfo(term=1, stage_count=1, session_idle_s=30.0))
    pipe = FakePipeline()
    core.add(request("a", tuple(range(1, 200)), max_new=2))
    core.add(request("b", tuple(range(3, 200)), max_new=2))
    b = core.running["b"]
    b.prefilled, b.touched = 8, clock.now  # b's first chunk went ahead of a's
    pipe.sessions["b"] = list(range(3, 11))
    order = []
    for _ in range(6):
        frame = core.next_frame()
        order.append("".join(s.request_id for s in frame.segments))
        core.on_result(pipe.answer(frame))
        clock.now += 4
    # a's chunks fill the steps until b has waited 12 s (> 30 / 3); then b goes once.
    assert order == ["a", "a", "a", "b", "a", "a"]


def test_a_result_no_request_owns_gets_its_session_ended_once() -> None:
    """Results for a session this core never opened (a faulty peer's frames) come
    back unclaimed: the core ends that session on the stages, once, instead of
    leaving it to hold a slot until the stages' idle sweep; the running request goes
    on as before."""
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(request("mine", (1, 2, 3), max_new=4))
    frame = core.next_frame()
    answer = pipe.answer(frame)
    stray = SegmentResult("stray", "stray", 5, (7,))
    got: dict[str, list] = {}
    collect(got, core.on_result(FrameResult(1, frame.frame_id, (*answer.results, stray))))
    assert core.on_result(FrameResult(1, 99, (stray,))) == []
    following = core.next_frame()
    ends = [s for s in following.segments if s.kind is SegmentKind.END]
    assert [(s.session_id, s.keep_prefix) for s in ends] == [("stray", False)]
    collect(got, core.on_result(pipe.answer(following)))
    for request_id, (tokens, finish, error) in run_to_end(core, pipe).items():
        got[request_id][0].extend(tokens)
        got[request_id][1:] = [finish, error]
    assert got["mine"][0] == greedy((1, 2, 3), 4) and got["mine"][2] is None
    assert core.stale.count("unclaimed") == 2


def test_a_prompt_chunk_on_a_slow_link_is_cut_by_its_time_on_the_wire() -> None:
    """Two stages and a slow link between them: prompt frames cost the stages 10 ms
    + 0.2 ms a row, but their activations take 4 ms a row on the wire, where the
    decoding requests' next frames wait behind them. Decode frames' rounds show the
    links' latency (30 ms), which is not counted against a chunk. The cut keeps a
    frame near ``decode_stall_ms`` (250 ms) by the wire: about 60 rows, not the
    1,200 the stages' compute alone would allow (the 512-row budget)."""
    from mesh.frames import Segment, StageTiming

    core, clock = core_with(stage_count=2, decode_stall_ms=250.0, prefix_cache_tokens=0)
    pipe = FakePipeline()

    def answered(frame, compute_ms: float, wire_ms: float) -> FrameResult:
        clock.now += (2 * compute_ms + wire_ms) / 1000.0
        result = pipe.answer(frame)
        timings = (StageTiming(0, compute_ms), StageTiming(1, compute_ms))
        return FrameResult(result.term, result.frame_id, result.results, timings)

    core.add(request("short", (7, 8, 9), max_new=400))
    core.on_result(answered(core.next_frame(), 5.0, 30.0))  # its prompt
    for _ in range(10):  # decode rounds: 30 ms between the stages
        core.on_result(answered(core.next_frame(), 5.0, 30.0))
    assert 29.0 < core.wire_base_ms < 31.0
    for rows in (64, 128, 256, 512, 100, 300):
        frame = core._pack(
            [Segment(f"p{rows}", f"p{rows}", SegmentKind.PREFILL, 0, token_ids=(1,) * rows)],
            core.info,
            clock.now,
        )
        compute = 10.0 + 0.2 * rows
        core.on_result(answered(frame, compute, 30.0 + 4.0 * rows))
    core.add(request("long", tuple(range(2, 91)) * 10, max_new=2))
    frame = core.next_frame()
    chunks = [s.token_count for s in frame.segments if s.kind is SegmentKind.PREFILL]
    assert chunks and 50 <= chunks[0] <= 64, chunks


@pytest.mark.parametrize(("step_ms", "first_chunk"), [(0.0, 64), (30.0, 39)])
def test_a_fresh_mesh_cuts_its_first_prompt_chunks_among_decoders(
    step_ms: float, first_chunk: int
) -> None:
    """Until prompt frames of different sizes were measured, the fit cannot tell a
    frame's fixed cost from its rows'. Their cost per row with the fixed cost counted
    in stands in (one 20-row prompt frame measured at 30 ms: 1.5 ms a row, 166 rows
    in 250 ms), and a frame holds at most twice the rows of the largest prompt frame
    measured (40, one of them the decoding request's); with no prompt frame measured
    at all the first chunk is FIRST_PROMPT_ROWS. Both took the whole 512-row budget
    before (about 21 s a chunk on a 1 Mbit/s link between hosts)."""
    from stage.frontend.engine_core import FIRST_PROMPT_ROWS

    assert FIRST_PROMPT_ROWS == 64
    core, _ = core_with(decode_stall_ms=250.0, prefix_cache_tokens=0)
    pipe = FakePipeline(step_ms=step_ms)  # 0: answers carry no timings
    core.add(request("short", tuple(range(3, 23)), max_new=50))
    core.on_result(pipe.answer(core.next_frame()))  # its prompt: it decodes now
    assert core.prompt_cost.model() is None
    core.add(request("long", tuple(range(2, 91)) * 10, max_new=2))
    chunks = []
    for _ in range(3):
        frame = core.next_frame()
        chunks += [s.token_count for s in frame.segments if s.kind is SegmentKind.PREFILL]
        core.on_result(pipe.answer(frame))
    assert chunks[0] == first_chunk
    # The chunks grow, by doubling at most, as larger frames are measured (each costs
    # 30 ms here); with nothing measured they stay at the first size.
    if step_ms:
        assert chunks[0] < chunks[1] <= 2 * (chunks[0] + 1) and chunks[2] > chunks[1]
    else:
        assert chunks == [first_chunk] * 3


def test_a_fit_that_sees_no_cost_in_rows_grows_chunks_by_doubling() -> None:
    """Prompt frames of 17-33 rows on a slow link cost 0.4-0.9 s each, their fit finds
    no cost growing with rows (the link's latency and noise hide it), which read as
    "rows are free": the next chunk took the whole budget and held the decoding
    streams for 20 s (measured on namespace hosts at 1 Mbit/s). A frame now holds at
    most twice the rows of the largest measured."""
    core, _ = core_with(decode_stall_ms=250.0, prefix_cache_tokens=0)
    for rows, cost in ((33, 28.0), (18, 533.0), (22, 432.0), (22, 885.0), (18, 678.0)):
        core.prompt_cost.observe(rows, cost)
    assert core.prompt_cost.model() is not None and core.prompt_cost.model()[1] <= 0
    pipe = FakePipeline()
    core.add(request("short", (7, 8, 9), max_new=50))
    core.on_result(pipe.answer(core.next_frame()))
    core.add(request("long", tuple(range(2, 91)) * 10, max_new=2))
    frame = core.next_frame()
    chunks = [s.token_count for s in frame.segments if s.kind is SegmentKind.PREFILL]
    assert chunks == [2 * 33 - 1]
