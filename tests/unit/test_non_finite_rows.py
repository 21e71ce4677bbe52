"""Activations or logits that hold NaN or Inf (a stage whose compute overflowed in its
dtype, damaged weights, a faulty peer) fail their own segment with an error that says
so, instead of being run on and sampled from (token 0 under greedy, garbage text, a
poisoned KV); the frame's other segments run as they would alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from runtime_support import load_chain, package_of

from mesh.frames import Frame, Segment, SegmentKind
from mesh.types import LayerRange, SamplingParams
from stage.engine import StageEngine


@pytest.fixture(scope="module")
def engines(tiny_model_factory, tmp_path_factory):
    package = package_of(
        tiny_model_factory("llama", layers=4), tmp_path_factory.mktemp("finite") / "pkg"
    )
    ranges = (LayerRange(0, 2), LayerRange(2, 4))
    return [StageEngine(r, i, term=1) for i, r in enumerate(load_chain(package, ranges))]


def _prefill(session: str, tokens: tuple[int, ...]) -> Segment:
    return Segment(session, session, SegmentKind.PREFILL, 0, tokens, SamplingParams(), True)


def test_non_finite_activations_fail_their_segment_alone(engines) -> None:
    first, last = engines
    clean = Frame(1, 1, (_prefill("alone", (5, 6, 7)),))
    alone = last.process(first.process(clean).forward).result.results[0]
    frame = Frame(1, 2, (_prefill("bad", (1, 2)), _prefill("good", (5, 6, 7))))
    forward = first.process(frame).forward
    for value in (float("nan"), float("inf")):
        rows = forward.hidden.clone()
        rows[1, 3] = value  # the second row of "bad"
        result = last.process(Frame(1, 3, forward.segments, rows)).result
        bad, good = result.results
        assert bad.error is not None and "NaN or Inf" in bad.error.message
        assert bad.error.code == "INTERNAL"
        assert good.ok and good.token_ids == alone.token_ids
        assert last.runtime.session_length("bad") == 0


def test_non_finite_logits_fail_their_segment(engines, monkeypatch) -> None:
    first, last = engines
    forward = first.process(Frame(1, 4, (_prefill("nan-head", (8, 9)),))).forward
    real = last.runtime.forward_batch

    def poisoned(spans, inputs):
        out = real(spans, inputs)
        return replace(out, rows=torch.full_like(out.rows, float("nan")))

    monkeypatch.setattr(last.runtime, "forward_batch", poisoned)
    (answer,) = last.process(forward).result.results
    assert answer.error is not None and "NaN or Inf logits" in answer.error.message
    assert answer.token_ids == ()


def test_a_later_stage_refuses_token_ids_outside_the_vocabulary(engines) -> None:
    """The first stage checks the ids it embeds; the last checks those it keeps for
    penalties and verifies drafts against: a segment carrying one out of range fails
    alone."""
    first, last = engines
    frame = Frame(1, 5, (_prefill("ids-bad", (1, 2)), _prefill("ids-good", (5, 6, 7))))
    forward = first.process(frame).forward
    segments = (replace(forward.segments[0], token_ids=(1, 2**32 - 1)), forward.segments[1])
    bad, good = last.process(replace(forward, segments=segments)).result.results
    assert bad.error is not None and "out of range" in bad.error.message
    assert good.ok and good.token_ids
