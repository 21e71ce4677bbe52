"""Test support for stage 0's engine core: a fake pipeline, a clock, and loops that
step the core until it runs out of work.

The fake pipeline is a deterministic "model" over each session's tokens (the next
token is a hash of the tokens so far), applying the same crop rule, the same
verification rule and the same check of windows drafted ahead as the real stages;
it answers every segment of a frame.
"""

from __future__ import annotations

import random
from collections import deque

from mesh.frames import (
    ErrorInfo,
    Frame,
    FrameResult,
    Pooling,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
    TokenLogprob,
)
from mesh.speculative.drafter import Drafter
from mesh.types import SamplingParams
from stage.frontend.backend import GenerationRequest
from stage.frontend.engine_core import EngineCore
from stage.frontend.engine_types import EngineLimits, PipelineInfo

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def fake_score(before: list[int], token: int) -> TokenLogprob:
    """The fake model's log-probability of ``token`` after ``before``: 0 for its own
    next token, lower the farther ``token`` is from it; that token is the one
    alternative."""
    best = next_token(before)
    return TokenLogprob(-abs(best - token) / 10.0, ((best, 0.0),))


def prompt_scores(prompt: tuple[int, ...]) -> list[TokenLogprob]:
    """The scores of a prompt's tokens after its first."""
    return [fake_score(list(prompt[:i]), prompt[i]) for i in range(1, len(prompt))]


def fake_row(position: int, token: int) -> tuple[float, ...]:
    """The fake model's final hidden row at ``position`` holding ``token``."""
    return (float(token), float(position), 1.0)


def fake_pooled(segment: Segment) -> tuple[float, ...]:
    """A pooling segment's answer: the sum of its rows (mean) or its last row."""
    rows = [fake_row(segment.pos_start + i, t) for i, t in enumerate(segment.token_ids)]
    if segment.pooling is Pooling.NONE:
        return ()
    if segment.pooling is Pooling.LAST:
        return rows[-1]
    return tuple(sum(column) for column in zip(*rows, strict=True))


def fake_embedding(prompt: tuple[int, ...], pooling: str) -> tuple[float, ...]:
    """The whole prompt's pooled rows, as stage 0 should report them."""
    rows = [fake_row(p, t) for p, t in enumerate(prompt)]
    if pooling == "last":
        return rows[-1]
    return tuple(sum(column) / len(rows) for column in zip(*rows, strict=True))


def greedy(prompt: tuple[int, ...], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakePipeline:
    """Answers frames like a whole pipeline would: every segment, in order. Keeps
    prefixes as the stages do; a name in ``lost`` is one some stage no longer holds."""

    def __init__(self, step_ms: float = 0.0, capacity: int = 0) -> None:
        # The compute time each answer reports for the pipeline's slowest stage.
        self.step_ms = step_ms
        # Sessions a stage holds KV for (0: no limit); a new session over it is
        # refused as a stage refuses it.
        self.capacity = capacity
        self.sessions: dict[str, list[int]] = {}
        self.kept: dict[str, list[int]] = {}
        self.lost: set[str] = set()
        self.frames: list[Frame] = []
        # The last stage's verdicts: (position, token) of each session's last emitted
        # token; windows drafted ahead that do not start there are dropped unrun.
        self.verdicts: dict[str, tuple[int, int]] = {}
        self.dropped: list[Segment] = []
        # (session, error code) of every segment it refused.
        self.refused: list[tuple[str, str]] = []

    def answer(self, frame: Frame) -> FrameResult:
        """As a stage applies a frame: its ENDs first (wherever they sit in it), then
        its segments, whose new sessions copy what the sessions and kept prefixes
        held before the frame's rows ran, then its forget-prefix ENDs."""
        self.frames.append(frame)
        ended: dict[int, SegmentResult] = {}
        for index, segment in enumerate(frame.segments):
            if segment.kind is SegmentKind.END and not segment.forget_prefix:
                held = self.sessions.pop(segment.session_id, None)
                if segment.keep_prefix and held is not None:
                    self.kept[segment.session_id] = held[: segment.pos_start]
                ended[index] = SegmentResult(
                    segment.request_id, segment.session_id, 0, epoch=segment.epoch
                )
        before = {name: list(held) for name, held in self.kept.items()}
        before_sessions = {name: list(held) for name, held in self.sessions.items()}
        results = []
        for index, segment in enumerate(frame.segments):
            sid = segment.session_id
            if index in ended:
                results.append(ended[index])
                continue
            if segment.kind is SegmentKind.END:  # forget a kept prefix, after the rows
                results.append(SegmentResult(segment.request_id, sid, 0, epoch=segment.epoch))
                continue
            if sid not in self.sessions and 0 < self.capacity <= len(self.sessions):
                error = ErrorInfo("RESOURCE_EXHAUSTED", f"{len(self.sessions)} sessions held", 1)
                results.append(
                    SegmentResult(
                        segment.request_id, sid, segment.pos_start, error=error, epoch=segment.epoch
                    )
                )
                continue
            if sid not in self.sessions and segment.pos_start > 0:
                source = segment.prefix_from
                # A kept prefix, or a live session (a forked choice of n > 1).
                held = before.get(source) or before_sessions.get(source)
                if held is not None and len(held) < segment.pos_start:
                    held = None  # the source does not hold the positions the segment skips
                if source and held is not None and source not in self.lost:
                    self.sessions[sid] = held[: segment.pos_start]
                else:
                    code = "ABORTED" if source else "NOT_FOUND"
                    error = ErrorInfo(code, f"no session or prefix for {sid}", 1)
                    results.append(
                        SegmentResult(
                            segment.request_id,
                            sid,
                            segment.pos_start,
                            error=error,
                            epoch=segment.epoch,
                        )
                    )
                    continue
            if segment.ahead and self.verdicts.get(sid) != (
                segment.pos_start,
                segment.token_ids[0],
            ):
                self.dropped.append(segment)
                results.append(
                    SegmentResult(
                        segment.request_id,
                        sid,
                        segment.pos_start,
                        epoch=segment.epoch,
                        dropped=True,
                    )
                )
                continue
            held = self.sessions.setdefault(sid, [])
            del held[segment.pos_start :]
            held.extend(segment.token_ids)
            scored = tuple(
                fake_score(held[: segment.pos_start + 1 + i], token)
                for i, token in enumerate(segment.scored_tokens)
            )
            if segment.kind is SegmentKind.PREFILL and not segment.sample:
                pooled = fake_pooled(segment)
                at = segment.pos_start + 1 if segment.score or pooled else segment.pos_end
                results.append(
                    SegmentResult(
                        segment.request_id,
                        sid,
                        at,
                        epoch=segment.epoch,
                        prompt_logprobs=scored,
                        pooled=pooled,
                    )
                )
                continue
            if segment.kind is SegmentKind.VERIFY:
                emitted, accepted = [], 0
                for i in range(1, segment.token_count + 1):
                    draw = next_token(held[: segment.pos_start + i])
                    emitted.append(draw)
                    if i < segment.token_count and segment.token_ids[i] == draw:
                        accepted += 1
                        continue
                    break
                results.append(
                    SegmentResult(
                        segment.request_id,
                        sid,
                        segment.pos_start + 1,
                        emitted,
                        accepted,
                        epoch=segment.epoch,
                    )
                )
            else:
                results.append(
                    SegmentResult(
                        segment.request_id,
                        sid,
                        segment.pos_end,
                        [next_token(held)],
                        epoch=segment.epoch,
                        prompt_logprobs=scored,
                        pooled=fake_pooled(segment),
                    )
                )
        for result in results:
            if result.token_ids:
                last = result.pos_start + len(result.token_ids) - 1
                self.verdicts[result.session_id] = (last, result.token_ids[-1])
        for segment in frame.segments:
            if segment.kind is SegmentKind.END and segment.forget_prefix:
                self.kept.pop(segment.session_id, None)
        self.refused += [(r.session_id, r.error.code) for r in results if r.error is not None]
        timings = (StageTiming(0, self.step_ms),) if self.step_ms else ()
        return FrameResult(frame.term, frame.frame_id, tuple(results), timings)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(
    rid: str, prompt: tuple[int, ...], max_new: int = 6, stop=(), fork_of: str = ""
) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_new, SamplingParams(), frozenset(stop), fork_of)


def core_with(stage_count: int = 1, **limits) -> tuple[EngineCore, Clock]:
    clock = Clock()
    core = EngineCore(EngineLimits(**limits), clock)
    core.set_pipeline(PipelineInfo(term=1, stage_count=stage_count))
    return core, clock


def collect(out: dict[str, list], outcomes: list) -> None:
    """Add outcomes to ``out``: request id -> [tokens, finish reason, error]."""
    for outcome in outcomes:
        entry = out.setdefault(outcome.request_id, [[], None, None])
        if outcome.error is not None:
            entry[2] = outcome.error
        else:
            entry[0].extend(outcome.event.token_ids)
            entry[1] = outcome.event.finish_reason


def events_by_request(core: EngineCore, pipe: FakePipeline) -> dict[str, list]:
    """Step to the end (no request may fail); each request's events in order."""
    events: dict[str, list] = {}
    while (frame := core.next_frame()) is not None:
        for outcome in core.on_result(pipe.answer(frame)):
            assert outcome.error is None, outcome.error
            events.setdefault(outcome.request_id, []).append(outcome.event)
    return events


def run_to_end(core: EngineCore, pipe: FakePipeline, limit: int = 500) -> dict[str, list]:
    """Step until nothing is left to send; every request's committed tokens and finish."""
    out: dict[str, list] = {}
    for _ in range(limit):
        frame = core.next_frame()
        if frame is None:
            return out
        collect(out, core.on_result(pipe.answer(frame)))
    raise AssertionError("the core never ran out of work")


def run_pipelined(core: EngineCore, pipe: FakePipeline, limit: int = 500) -> dict[str, list]:
    """Like run_to_end, with as many frames in flight as the core sends."""
    out: dict[str, list] = {}
    for _ in range(limit):
        frames = []
        while (frame := core.next_frame()) is not None:
            frames.append(frame)
        if not frames:
            return out
        for frame in frames:
            collect(out, core.on_result(pipe.answer(frame)))
    raise AssertionError("the core never ran out of work")


def run_streaming(
    core: EngineCore,
    pipe: FakePipeline,
    arrivals: dict[int, list],
    cancels: dict[int, list[str]] | None = None,
    limit: int = 5000,
) -> dict[str, list]:
    """As stage 0's scheduler drives the core: after every answer it sends what the
    core packs (with the pipe full, frames of new prompts too) and joins new prompts
    to a frame of prompts not yet answered; ``arrivals`` adds requests and
    ``cancels`` cancels them (a client gone, a stop string) after the answer of that
    many frames. Frames are answered in the order they were sent."""
    cancels = dict(cancels or {})
    out: dict[str, list] = {}
    pending: deque[Frame] = deque()
    answered = 0

    def pump() -> None:
        while (frame := core.next_frame()) is not None:
            pending.append(frame)
        frame_id = core.open_prompts_frame()
        # Stage 0 computes the oldest frame; the frames behind it have not started.
        for index in range(1, len(pending)):
            frame = pending[index]
            if frame.frame_id == frame_id:
                joined = tuple(core.join_prompts_frame(frame_id))
                pending[index] = Frame(frame.term, frame_id, frame.segments + joined)

    for _ in range(limit):
        for run in arrivals.pop(answered, []):
            core.add(run)
        for request_id in cancels.pop(answered, []):
            core.cancel(request_id)
            out.setdefault(request_id, [[], None, None])[1] = "cancelled"
        pump()
        if not pending:
            if not arrivals:
                return out
            answered = min(arrivals)
            continue
        collect(out, core.on_result(pipe.answer(pending.popleft())))
        answered += 1
    raise AssertionError("the core never ran out of work")


def run_with_latency(
    core: EngineCore,
    pipe: FakePipeline,
    clock: Clock,
    round_s: float,
    limit: int = 20000,
) -> dict[str, list]:
    """Like run_pipelined, on a pipeline whose answers come ``round_s`` after a frame
    was sent and no sooner than ``pipe.step_ms`` after the previous answer (the
    slowest stage takes that long per frame); the clock moves to each answer."""
    out: dict[str, list] = {}
    pending: deque[tuple[float, Frame]] = deque()
    step_s = pipe.step_ms / 1000.0
    for _ in range(limit):
        while (frame := core.next_frame()) is not None:
            due = clock.now + round_s
            if pending:
                due = max(due, pending[-1][0] + step_s)
            pending.append((due, frame))
        if not pending:
            return out
        due, frame = pending.popleft()
        clock.now = max(clock.now, due)
        collect(out, core.on_result(pipe.answer(frame)))
    raise AssertionError("the core never ran out of work")


class OracleDrafter(Drafter):
    """Proposes the fake model's own continuation, each token wrong with probability
    ``wrong`` (seeded)."""

    name = "oracle"

    def __init__(self, wrong: float, seed: int) -> None:
        super().__init__()
        self.wrong = wrong
        self.random = random.Random(seed)

    def _propose(self, k: int) -> list[int]:
        tokens = list(self._tokens)
        for _ in range(k):
            token = next_token(tokens)
            if self.random.random() < self.wrong:
                token = (token + 1) % VOCAB
            tokens.append(token)
        return tokens[len(self._tokens) :]
