"""Embeddings in stage 0's engine core (``GenerationRequest.pooling``): against the
fake pipeline of engine_support, whose last stage pools rows it makes up from each
position and token."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_support import (
    FakePipeline,
    core_with,
    events_by_request,
    fake_embedding,
    greedy,
    request,
    run_to_end,
)

from mesh.errors import InvalidRequest
from mesh.frames import Pooling, SegmentKind
from stage.frontend.engine_types import PipelineInfo

PROMPT = tuple(range(3, 40))


def embedding(rid: str, prompt: tuple[int, ...], pooling: str = "mean"):
    return replace(request(rid, prompt, max_new=0), pooling=pooling)


def reads_of(pipe: FakePipeline, session: str) -> list:
    return [
        s
        for f in pipe.frames
        for s in f.segments
        if s.session_id == session and s.kind is SegmentKind.PREFILL
    ]


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("chunk", [5, 8, 64])
def test_a_prompt_read_in_chunks_gets_its_whole_embedding(pooling: str, chunk: int) -> None:
    core, _ = core_with(prefill_chunk_tokens=chunk)
    pipe = FakePipeline()
    core.add(embedding("e", PROMPT, pooling))
    core.add(request("plain", (9, 8, 7), max_new=4))
    events = events_by_request(core, pipe)
    (only,) = events["e"]
    assert only.token_ids == () and only.finish_reason == "length"
    assert only.embedding == pytest.approx(fake_embedding(PROMPT, pooling))
    # A plain request beside it is untouched and pools nothing.
    assert [t for e in events["plain"] for t in e.token_ids] == greedy((9, 8, 7), 4)
    assert all(not e.embedding for e in events["plain"])
    assert not any(s.pooling is not Pooling.NONE for s in reads_of(pipe, "plain"))
    reads = reads_of(pipe, "e")
    assert sum(s.token_count for s in reads) == len(PROMPT)
    pooled = [s for s in reads if s.pooling is not Pooling.NONE]
    # Mean pooling needs every chunk's rows; last pooling only the final chunk's.
    assert pooled == (reads if pooling == "mean" else reads[-1:])
    assert not pipe.sessions and not core.running


def test_a_one_token_prompt_is_its_own_embedding() -> None:
    core, _ = core_with()
    pipe = FakePipeline()
    core.add(embedding("e", (11,)))
    (event,) = events_by_request(core, pipe)["e"]
    assert event.embedding == pytest.approx(fake_embedding((11,), "mean"))


def test_an_embedded_prompt_reads_everything_despite_the_prefix_cache() -> None:
    core, _ = core_with(prefix_cache_tokens=4096)
    pipe = FakePipeline()
    core.add(request("first", PROMPT, max_new=3))
    run_to_end(core, pipe)
    assert pipe.kept
    core.add(embedding("e", PROMPT))
    (event,) = events_by_request(core, pipe)["e"]
    assert event.embedding == pytest.approx(fake_embedding(PROMPT, "mean"))
    reads = reads_of(pipe, "e")
    assert reads[0].pos_start == 0 and not reads[0].prefix_from


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_pipeline_lost_in_the_middle_of_an_embedding_reads_it_again(pooling: str) -> None:
    core, clock = core_with(prefill_chunk_tokens=8, recovery_timeout_s=30)
    pipe = FakePipeline()
    core.add(embedding("e", PROMPT, pooling))
    for _ in range(2):  # two chunks answered
        assert core.on_result(pipe.answer(core.next_frame())) == []
    core.next_frame()  # never answered
    core.set_pipeline(None)
    pipe.sessions.clear()
    clock.now += 2
    core.set_pipeline(PipelineInfo(term=2, stage_count=1))
    core.expire()
    (event,) = events_by_request(core, pipe)["e"]
    assert event.embedding == pytest.approx(fake_embedding(PROMPT, pooling))


def test_a_chunk_answer_that_never_came_fails_the_request_rather_than_a_wrong_vector() -> None:
    core, _ = core_with(prefill_chunk_tokens=8)
    pipe = FakePipeline()
    core.add(embedding("e", PROMPT))
    frame = core.next_frame()
    answer = pipe.answer(frame)
    # The first chunk's pooled rows are lost on the way back.
    lost = replace(answer, results=tuple(replace(r, pooled=()) for r in answer.results))
    assert core.on_result(lost) == []
    errors = []
    while (frame := core.next_frame()) is not None:
        errors += [o.error for o in core.on_result(pipe.answer(frame)) if o.error is not None]
    assert len(errors) == 1 and "never came back" in errors[0].message
    assert not core.running


def test_only_a_known_pooling_is_admitted() -> None:
    core, _ = core_with()
    with pytest.raises(InvalidRequest, match="pooling 'max' is unknown"):
        core.add(embedding("e", PROMPT, "max"))
    with pytest.raises(InvalidRequest, match="max_new_tokens is 0"):
        core.add(request("r", PROMPT, max_new=0))
