"""Prompt scoring in stage 0's engine core (completions with ``echo`` and
``logprobs``): against the fake pipeline of engine_support, which scores every row
of a scored chunk and the token after it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_support import (
    FakePipeline,
    core_with,
    events_by_request,
    greedy,
    next_token,
    prompt_scores,
    request,
    run_to_end,
)

from mesh.errors import InvalidRequest
from mesh.frames import SegmentKind
from stage.frontend.engine_types import PipelineInfo

PROMPT = tuple(range(3, 40))


def scoring(rid: str, prompt: tuple[int, ...], max_new: int):
    return replace(request(rid, prompt, max_new=max_new), score_prompt=True)


@pytest.mark.parametrize("chunk", [5, 8, 64])
def test_a_prompt_read_in_chunks_is_scored_at_every_position(chunk: int) -> None:
    core, _ = core_with(prefill_chunk_tokens=chunk)
    pipe = FakePipeline()
    core.add(scoring("s", PROMPT, max_new=4))
    core.add(request("plain", (9, 8, 7), max_new=4))
    events = events_by_request(core, pipe)
    first = events["s"][0]
    assert list(first.prompt_logprobs) == prompt_scores(PROMPT)
    assert [t for e in events["s"] for t in e.token_ids] == greedy(PROMPT, 4)
    assert all(not e.prompt_logprobs for e in events["s"][1:])
    assert all(not e.prompt_logprobs for e in events["plain"])
    # Every chunk but the last named the token after it; only scored prompts did.
    chunks = [s for f in pipe.frames for s in f.segments if s.kind is SegmentKind.PREFILL]
    scored = [s for s in chunks if s.session_id == "s"]
    assert all(s.score for s in scored) and not any(s.score for s in chunks if s not in scored)
    assert [s.next_token for s in scored[:-1]] == [PROMPT[s.pos_end] for s in scored[:-1]]
    assert scored[-1].next_token is None
    assert not pipe.sessions


def test_nothing_to_generate_ends_with_the_scores_alone() -> None:
    core, _ = core_with(prefill_chunk_tokens=16)
    pipe = FakePipeline()
    core.add(scoring("s", PROMPT, max_new=0))
    (event,) = events_by_request(core, pipe)["s"]
    assert event.token_ids == () and event.finish_reason == "length"
    assert list(event.prompt_logprobs) == prompt_scores(PROMPT)
    assert not pipe.sessions and not core.running


def test_only_a_scored_prompt_may_ask_for_no_tokens() -> None:
    core, _ = core_with()
    with pytest.raises(InvalidRequest, match="max_new_tokens is 0"):
        core.add(request("r", PROMPT, max_new=0))


def test_a_single_token_prompt_has_nothing_to_score() -> None:
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(scoring("s", (5,), max_new=2))
    events = events_by_request(core, pipe)["s"]
    assert events[0].prompt_logprobs == ()
    assert [t for e in events for t in e.token_ids] == greedy((5,), 2)


def test_a_scored_prompt_reads_everything_despite_the_prefix_cache() -> None:
    core, _ = core_with(prefix_cache_tokens=4096)
    pipe = FakePipeline()
    core.add(request("first", PROMPT, max_new=3))
    run_to_end(core, pipe)
    assert pipe.kept  # the first request's positions are kept for later prompts
    core.add(scoring("s", PROMPT, max_new=3))
    events = events_by_request(core, pipe)["s"]
    assert list(events[0].prompt_logprobs) == prompt_scores(PROMPT)
    reads = [s for f in pipe.frames for s in f.segments if s.session_id == "s"]
    assert reads[0].pos_start == 0 and not reads[0].prefix_from


def test_a_pipeline_lost_in_the_middle_of_a_scored_prompt_scores_it_again() -> None:
    core, clock = core_with(prefill_chunk_tokens=8, recovery_timeout_s=30)
    pipe = FakePipeline()
    core.add(scoring("s", PROMPT, max_new=3))
    for _ in range(2):  # two chunks answered
        assert core.on_result(pipe.answer(core.next_frame())) == []
    lost = core.next_frame()  # never answered
    assert lost.segments[0].score
    core.set_pipeline(None)
    pipe.sessions.clear()
    clock.now += 2
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    core.expire()
    events = events_by_request(core, pipe)["s"]
    assert list(events[0].prompt_logprobs) == prompt_scores(PROMPT)
    assert [t for e in events for t in e.token_ids] == greedy(PROMPT, 3)


def test_after_the_prompt_a_recovery_reads_again_without_scoring() -> None:
    core, clock = core_with(recovery_timeout_s=30)
    pipe = FakePipeline()
    core.add(scoring("s", PROMPT, max_new=6))
    committed = []
    for _ in range(3):
        for outcome in core.on_result(pipe.answer(core.next_frame())):
            committed.append(outcome.event)
    assert list(committed[0].prompt_logprobs) == prompt_scores(PROMPT)
    core.next_frame()  # lost
    core.set_pipeline(None)
    pipe.sessions.clear()
    clock.now += 2
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    core.expire()
    resend = core.next_frame()
    assert resend.segments[0].pos_start == 0 and not resend.segments[0].score
    committed += core.on_result(pipe.answer(resend))
    rest = events_by_request(core, pipe)["s"]
    events = [getattr(e, "event", e) for e in committed] + rest
    assert [t for e in events for t in e.token_ids] == greedy(PROMPT, 6)
    assert sum(bool(e.prompt_logprobs) for e in events) == 1


def test_a_scored_chunk_answer_of_an_old_term_is_not_taken() -> None:
    core, _ = core_with(prefill_chunk_tokens=8)
    pipe = FakePipeline()
    core.add(scoring("s", PROMPT, max_new=2))
    frame = core.next_frame()
    answer = pipe.answer(frame)
    stale = replace(answer, term=0)
    (chunk,) = stale.results
    wrong = replace(
        chunk, prompt_logprobs=tuple(replace(e, logprob=-9.0) for e in chunk.prompt_logprobs)
    )
    assert core.on_result(answer) == []
    assert core.on_result(replace(stale, results=(wrong,))) == []  # after the good one
    events = events_by_request(core, pipe)["s"]
    assert list(events[0].prompt_logprobs) == prompt_scores(PROMPT)
    assert next_token(list(PROMPT)) == events[0].token_ids[0]


# ---- the last stage, on a real split of a tiny model ---------------------------------


def test_the_last_stage_scores_chunks_as_the_whole_model_does(tiny_model_factory, tmp_path) -> None:
    """Two stages of a tiny Llama run a prompt in three scored chunks (the middle one
    with a decode segment of another session beside it): every prompt token's score
    and alternatives equal the unsplit model's log-softmax within 1e-4, and the last
    chunk samples the model's greedy token."""
    import torch
    from runtime_support import full_logits, load_chain, package_of, reference_model

    from mesh.frames import Frame, Segment
    from mesh.types import LayerRange, SamplingParams
    from stage.engine import StageEngine

    model_dir = tiny_model_factory("llama", layers=4)
    package = package_of(model_dir, tmp_path / "pkg")
    first, last = (
        StageEngine(runtime, index, term=1)
        for index, runtime in enumerate(load_chain(package, (LayerRange(0, 2), LayerRange(2, 4))))
    )
    torch.manual_seed(3)
    prompt = torch.randint(0, 1000, (23,)).tolist()
    want = torch.log_softmax(full_logits(reference_model(model_dir), torch.tensor(prompt)), -1)
    params = SamplingParams(top_logprobs=3)
    cuts = [(0, 9), (9, 17), (17, 23)]
    scores, answers = [], []
    for number, (start, end) in enumerate(cuts):
        final = end == len(prompt)
        segments = [
            Segment(
                "r",
                "s",
                SegmentKind.PREFILL,
                start,
                tuple(prompt[start:end]),
                params if start == 0 else None,
                sample=final,
                score=True,
                next_token=None if final else prompt[end],
            )
        ]
        if number == 1:
            other = Segment("o", "o", SegmentKind.PREFILL, 0, (5, 6, 7), SamplingParams())
            segments.insert(0, other)
        frame = Frame(1, number + 1, tuple(segments))
        forward = first.process(frame).forward
        result = last.process(forward).result
        answer = result.results[-1]
        assert answer.ok, answer.error
        if not final:
            assert answer.pos_start == start + 1 and answer.token_ids == ()
        scores += answer.prompt_logprobs
        answers.append(answer)
    assert len(scores) == len(prompt) - 1
    for position, entry in enumerate(scores, start=1):
        row = want[position - 1]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert answers[-1].token_ids == (int(want[-1].argmax()),)
    assert answers[-1].pos_start == len(prompt)


def test_a_scored_token_outside_the_vocabulary_fails_its_segment_alone(
    tiny_model_factory, tmp_path
) -> None:
    from runtime_support import load_chain, package_of

    from mesh.frames import Frame, Segment
    from mesh.types import LayerRange, SamplingParams
    from stage.engine import StageEngine

    package = package_of(tiny_model_factory("llama", layers=4), tmp_path / "pkg")
    (engine,) = (StageEngine(r, 0, term=1) for r in load_chain(package, (LayerRange(0, 4),)))
    bad = Segment(
        "bad", "bad", SegmentKind.PREFILL, 0, (1, 2), SamplingParams(), False, score=True,
        next_token=10**6,
    )  # fmt: skip
    good = Segment("good", "good", SegmentKind.PREFILL, 0, (3, 4), SamplingParams())
    result = engine.process(Frame(1, 1, (bad, good))).result
    failed, ok = result.results
    assert failed.error is not None and "outside the vocabulary" in failed.error.message
    assert ok.ok and len(ok.token_ids) == 1


def test_a_scored_prompt_goes_in_chunks_of_at_most_128_tokens() -> None:
    from stage.frontend.engine_prompts import SCORED_CHUNK_TOKENS

    core, _ = core_with(prefill_chunk_tokens=512, step_tokens=512)
    pipe = FakePipeline()
    prompt = tuple(i % 90 for i in range(300))
    core.add(scoring("s", prompt, max_new=1))
    core.add(request("plain", prompt, max_new=1))
    events = events_by_request(core, pipe)
    assert list(events["s"][0].prompt_logprobs) == prompt_scores(prompt)
    chunks = [s for f in pipe.frames for s in f.segments if s.kind is SegmentKind.PREFILL]
    scored = [s.token_count for s in chunks if s.session_id == "s"]
    assert scored == [SCORED_CHUNK_TOKENS, SCORED_CHUNK_TOKENS, 300 - 2 * SCORED_CHUNK_TOKENS]
    assert [s.token_count for s in chunks if s.session_id == "plain"] == [300]
