"""Stage 0's engine core against a fake pipeline with its events in any order, as the
scheduler meets them: answers, arrivals (some with a second choice, some with stop
tokens) and cancellations (clients gone) come one at a time and each is followed by
the scheduler's pump (send what the core packs, join new prompts to the frame of
new prompts that stage 0 has not started), and now and then the pipeline is
replaced, or stalls past the round timeout first, and frames of the old pipeline
are answered late. Over random configurations (1-3 stages, small session limits, step
budgets, prefix cache, prompts ahead, speculation with drafters that are always,
sometimes or often wrong, windows drafted ahead): every request that was not
cancelled gets the tokens and finish it gets alone, no stage is asked to hold more
sessions than it may or to copy what it does not hold, and nothing is left on the
stages or in the core at the end.

Cancellations between answers are what found a request cancelled while its prompt
waited in an unstarted frame of new prompts: its END joined that frame with the
next arrival, ran before the prompt, and left a session that later requests found
the stage full of (429s)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import replace

import pytest
from engine_support import (
    VOCAB,
    Clock,
    FakePipeline,
    OracleDrafter,
    collect,
    core_with,
    prompt_scores,
    request,
    run_to_end,
)

from mesh.frames import Frame
from mesh.speculative import FixedWindow
from stage.frontend.engine_core import EngineCore
from stage.frontend.engine_types import EngineLimits, PipelineInfo

SEEDS = 400


def alone(prompt: tuple[int, ...], max_new: int, stop: frozenset[int]) -> list:
    """A request's tokens, finish and error when it runs by itself."""
    core, _ = core_with(stage_count=1)
    core.add(replace(request("x", prompt, max_new=max_new, stop=stop), score_prompt=True))
    return run_to_end(core, FakePipeline())["x"]


def run_interleaved(seed: int) -> tuple[dict[str, list], dict[str, list], set[str], list[str]]:
    """One random configuration and event order: (what each request got, what it
    gets alone, the requests cancelled, what went wrong on the stages or in the
    core)."""
    rng = random.Random(seed)
    stage_count = rng.choice([1, 2, 3])
    capacity = rng.choice([2, 3, 4, 6])
    wrong, window = rng.choice([0.0, 0.2, 0.6]), rng.choice([1, 3, 5])

    def speculation(req):
        drafter = OracleDrafter(wrong, seed)
        drafter.begin(req.prompt_tokens)
        return drafter, FixedWindow(window), "oracle"

    limits = EngineLimits(
        max_sessions=capacity,
        max_queued=64,
        prompts_ahead=rng.random() < 0.7,
        step_tokens=rng.choice([2, 3, 5, 8, 64]),
        prefix_cache_tokens=rng.choice([0, 0, 4096]),
        max_depth=rng.choice([1, 2, 3]),
    )
    clock = Clock()
    core = EngineCore(limits, clock, speculation if rng.random() < 0.5 else None)
    term = 1
    core.set_pipeline(PipelineInfo(term=term, stage_count=stage_count, kv_sessions=capacity))
    pipe = FakePipeline(capacity=capacity)
    pipes = [pipe]
    counted: list[int] = []  # refusals of each replaced pipeline before it was replaced
    arrivals, expected, to_cancel = [], {}, []
    scores_wanted: dict[str, list] = {}
    scores_got: dict[str, list] = {}

    def take(outcomes: list) -> None:
        for outcome in outcomes:
            if outcome.event is not None and outcome.event.prompt_logprobs:
                scores_got.setdefault(outcome.request_id, []).append(outcome.event.prompt_logprobs)
        collect(got, outcomes)

    base = [3, 4, 5, 6] * rng.choice([1, 3])
    for i in range(rng.randint(3, 14)):
        prompt = tuple(base + [i % 5, rng.randrange(VOCAB)][: rng.choice([1, 2])])
        scored = rng.random() < 0.2  # echo with logprobs: the prompt is scored
        max_new = rng.choice([0, 1, 2, 5] if scored else [1, 2, 5, 9])
        stop = frozenset([rng.randrange(VOCAB)]) if rng.random() < 0.3 else frozenset()
        runs = [request(f"p{i}", prompt, max_new=max_new, stop=stop)]
        if scored:
            runs = [replace(runs[0], score_prompt=True)]
            scores_wanted[f"p{i}"] = prompt_scores(prompt)
        elif rng.random() < 0.3:
            runs.append(request(f"p{i}-1", prompt, max_new=max_new, stop=stop, fork_of=f"p{i}"))
        for run in runs:
            arrivals.append(run)
            expected[run.request_id] = alone(prompt, max_new, stop)
            if rng.random() < 0.5:
                to_cancel.append(run.request_id)
    got: dict[str, list] = {}
    pending: deque[Frame] = deque()
    added: set[str] = set()
    cancelled: set[str] = set()
    reloads = 1 if rng.random() < 0.3 else 0
    stalls = 1 if rng.random() < 0.2 else 0
    # Frames of a replaced pipeline, answered late by its old stages (a stage that
    # hung and woke up): stage 0 must drop what they say.
    late: deque[tuple[FakePipeline, Frame]] = deque()

    def pump() -> None:
        while (frame := core.next_frame()) is not None:
            pending.append(frame)
        frame_id = core.open_prompts_frame()
        started = rng.choice([0, 1, 1, 2])  # frames stage 0 has taken up
        for index in range(started, len(pending)):
            frame = pending[index]
            if frame.frame_id == frame_id:
                joined = tuple(core.join_prompts_frame(frame_id))
                pending[index] = Frame(frame.term, frame_id, frame.segments + joined)

    for _ in range(20000):
        cancellable = [rid for rid in to_cancel if rid in added]
        events = ["answer"] * 3 * bool(pending) + ["arrive"] * bool(arrivals)
        events += ["cancel"] * bool(cancellable) + ["reload"] * bool(
            reloads and (pending or core.running)
        )
        events += ["stall"] * bool(stalls and pending) + ["late"] * bool(late)
        if not events:
            break
        event = rng.choice(events)
        if event == "answer":
            clock.now += 0.01
            take(core.on_result(pipe.answer(pending.popleft())))
        elif event == "arrive":
            for run in arrivals[: rng.choice([1, 1, 2, 3])]:
                arrivals.remove(run)
                core.add(run)
                added.add(run.request_id)
        elif event == "cancel":
            rid = rng.choice(cancellable)
            to_cancel.remove(rid)
            core.cancel(rid)
            cancelled.add(rid)
        elif event == "stall":  # no answer within the round timeout: a reload follows
            stalls -= 1
            reloads = max(reloads, 1)
            clock.now += limits.round_timeout_s + 1.0
            take(core.expire())
        elif event == "late":
            old, frame = late.popleft()
            take(core.on_result(old.answer(frame)))
        else:  # the pipeline is replaced: the new stages hold nothing
            reloads -= 1
            counted.append(len(pipe.refused))
            late.extend((pipe, frame) for frame in pending if rng.random() < 0.5)
            pending.clear()
            pipe = FakePipeline(capacity=capacity)
            pipes.append(pipe)
            term += 1
            info = PipelineInfo(term=term, stage_count=stage_count, kv_sessions=capacity)
            take(core.set_pipeline(info))
        pump()
    problems = []
    if pipe.sessions:
        problems.append(f"sessions left on the stages: {sorted(pipe.sessions)}")
    refused = [r for each, n in zip(pipes, [*counted, None], strict=True) for r in each.refused[:n]]
    if refused:
        problems.append(f"segments the stages refused: {refused}")
    if core.running or core.frames or core.waiting:
        problems.append(f"left in the core: {sorted(core.running)}, {sorted(core.frames)}")
    for rid, wanted in scores_wanted.items():
        if rid in cancelled or (rid in got and got[rid][2] is not None):
            continue
        if scores_got.get(rid) != [tuple(wanted)] and len(wanted) > 0:
            problems.append(f"{rid}: prompt scores {scores_got.get(rid)} instead of {wanted}")
    return got, expected, cancelled, problems


@pytest.mark.parametrize("block", range(4))
def test_events_in_any_order_change_no_output_and_leave_nothing_behind(block: int) -> None:
    per_block = SEEDS // 4
    for seed in range(block * per_block, (block + 1) * per_block):
        got, expected, cancelled, problems = run_interleaved(seed)
        assert not problems, (seed, problems)
        for rid, (tokens, finish, error) in expected.items():
            if rid in cancelled:
                continue
            assert rid in got, (seed, rid)
            assert got[rid][2] is None, (seed, rid, got[rid][2])
            assert (got[rid][0], got[rid][1]) == (tokens, finish), (seed, rid)
            assert error is None
