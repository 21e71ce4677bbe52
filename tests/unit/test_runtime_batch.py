"""Batched frames: several sessions' segments in one forward pass give every segment
the logits it gets alone, for every family, split, mix of kinds and crop; a bad
segment is refused alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runtime_support import (
    FAMILIES,
    LAYERS,
    SPLITS,
    batch_round,
    load_chain,
    max_diff,
    package_of,
    run_batch,
    run_chain,
)

from mesh.runtime import Span

TOLERANCE = 1e-4
VOCAB = 49152


@pytest.fixture(scope="module")
def packages(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            model_dir = tiny_model_factory(family, layers=LAYERS)
            cache[family] = package_of(model_dir, tmp_path_factory.mktemp(f"pkg-{family}") / "pkg")
        return cache[family]

    return get


@pytest.mark.parametrize("stage_count", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_segment_gets_the_logits_it_gets_alone(
    packages: Callable[[str], Path], family: str, stage_count: int
) -> None:
    package = packages(family)
    batched = load_chain(package, SPLITS[stage_count])
    alone = load_chain(package, SPLITS[stage_count])
    rng = random.Random(f"{family}-{stage_count}")
    sessions = [f"s{i}" for i in range(5)]
    tokens = {
        s: torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(sessions)
    }
    lengths = dict.fromkeys(sessions, 0)
    for _ in range(6):
        plan = batch_round(rng, lengths, tokens)
        spans = [Span(s, start, count) for s, start, count in plan]
        ids = torch.cat([tokens[s][start : start + count] for s, start, count in plan])
        got = run_batch(batched, spans, ids)
        for (session, start, count), logits in zip(plan, got, strict=True):
            want = run_chain(alone, session, start, tokens[session][start : start + count])
            assert max_diff(logits, want) < TOLERANCE, (session, start, count)
            lengths[session] = start + count


def test_logit_rows_pick_the_last_rows(packages: Callable[[str], Path]) -> None:
    stage = load_chain(packages("llama"), SPLITS[1])[0]
    ids = torch.arange(10, 22)
    spans = [Span("a", 0, 5, logit_rows=1), Span("b", 0, 4, logit_rows=0), Span("c", 0, 3)]
    out = stage.forward_batch(spans, ids)
    assert [out.of(i).shape[0] for i in range(3)] == [1, 0, 3]
    alone = load_chain(packages("llama"), SPLITS[1])[0]
    assert max_diff(out.of(0), alone.forward("a", 0, ids[:5])[-1:]) < TOLERANCE
    assert max_diff(out.of(2), alone.forward("c", 0, ids[9:12])) < TOLERANCE
    assert stage.session_length("b") == 4


def test_a_bad_segment_is_refused_alone(packages: Callable[[str], Path]) -> None:
    first, last = load_chain(packages("llama"), SPLITS[2])
    ids = torch.arange(1, 8)
    spans = [
        Span("ok", 0, 3),
        Span("gap", 5, 2),  # the session holds 0 tokens: it cannot start at 5
        Span("ok", 3, 1),  # the same session twice in one frame
        Span("fine", 0, 1),
    ]
    out = first.forward_batch(spans, ids)
    assert sorted(out.errors) == [1, 2]
    assert "resend the frame from position 0" in str(out.errors[1])
    assert "two segments in one frame" in str(out.errors[2])
    assert out.rows.shape == (4, first.hidden_size)
    assert first.session_length("ok") == 3 and first.session_length("gap") == 0
    bad_ids = torch.tensor([1, 2, VOCAB + 5])
    out = first.forward_batch([Span("x", 0, 2), Span("y", 0, 1)], bad_ids)
    assert list(out.errors) == [1] and "out of range" in str(out.errors[1])
    with pytest.raises(Exception, match="rows"):
        last.forward_batch([Span("z", 0, 2)], torch.zeros(3, last.hidden_size))


def test_a_session_whose_kv_cannot_be_allocated_is_refused_alone(
    packages: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocator out of memory for one session's KV (here any session asking for
    more than 256 positions, as a process under its memory limit sees it) refuses that
    segment with a retryable error saying what to do; the frame's other segments run
    and give the rows they give alone."""
    from mesh.errors import CapacityExceeded
    from mesh.runtime import sessions

    (alone,) = load_chain(packages("llama"), SPLITS[1])
    reference = alone.forward_batch([Span("small", 0, 3)], torch.arange(1, 4)).rows
    (stage,) = load_chain(packages("llama"), SPLITS[1])
    real_zeros = torch.zeros

    def zeros(*shape, **kwargs):
        if len(shape) == 1 and isinstance(shape[0], tuple) and shape[0][4] > 256:
            # What torch's CPU allocator raises when malloc fails.
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ...")
        return real_zeros(*shape, **kwargs)

    monkeypatch.setattr(sessions.torch, "zeros", zeros)
    ids = torch.cat([torch.arange(1, 4), torch.arange(1, 301)])
    out = stage.forward_batch([Span("small", 0, 3), Span("big", 0, 300)], ids)
    assert list(out.errors) == [1]
    assert isinstance(out.errors[1], CapacityExceeded)
    assert "out of memory for" in str(out.errors[1]) and "--kv-max-sessions" in str(out.errors[1])
    assert max_diff(out.rows[:1], reference[:1]) <= TOLERANCE
    assert stage.session_length("small") == 3 and stage.session_length("big") == 0


def test_out_of_memory_is_told_from_other_errors() -> None:
    from mesh.errors import out_of_memory

    try:
        torch.zeros((2**44,))
    except RuntimeError as error:  # a real allocation that cannot succeed
        assert out_of_memory(error)
    assert out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("shape mismatch"))
    assert not out_of_memory(ValueError("can't allocate memory"))
