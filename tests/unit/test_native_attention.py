"""Attention on the stage's own CPU kernel (mesh/runtime/kernels/attend.c): close to a
float64 reference, every row bit-identical alone and inside any frame, with 1 and 2
threads, and the new keys and values written as torch writes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from mesh.runtime import native, native_attention, qkernels
from mesh.runtime.block import SegmentRows

pytestmark = pytest.mark.skipif(
    native.library() is None,
    reason="the stage's CPU kernels need x86-64 with AVX-512 VNNI and a C compiler",
)

CAPACITY = 160


@pytest.fixture(autouse=True)
def native_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qkernels, "MODE", "auto")


@dataclass
class Cache:
    """The one method of a session cache the kernel's caller reads."""

    buffer: torch.Tensor

    def layer(self, layer_idx: int) -> torch.Tensor:
        return self.buffer


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    dim: int

    @property
    def width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.dim


SHAPES = [Shape(9, 3, 64), Shape(4, 2, 16), Shape(8, 8, 128), Shape(4, 1, 24), Shape(6, 2, 8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cache_for(shape: Shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, shape.kv_heads, CAPACITY, shape.dim, generator=generator).to(dtype)


def frame_rows(shape: Shape, rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, shape.width, generator=generator) * 2).to(dtype)


def run(
    shape: Shape,
    qkv: torch.Tensor,
    segments: list[tuple[torch.Tensor, int, int]],
    window: int | None = None,
) -> torch.Tensor:
    """``segments``: (cache, first position, rows), in frame order."""
    parts, row = [], 0
    for buffer, at, count in segments:
        parts.append(SegmentRows(Cache(buffer), row, at, count, (None, None), window))  # type: ignore[arg-type]
        row += count
    assert native_attention.usable(qkv, shape.dim, shape.heads // shape.kv_heads)
    out = native_attention.attend(
        qkv, parts, 0, shape.heads, shape.kv_heads, shape.dim, shape.dim**-0.5, window is not None
    )
    assert out is not None
    return out


def reference(
    shape: Shape, qkv: torch.Tensor, buffer: torch.Tensor, at: int, window: int | None
) -> torch.Tensor:
    """float64 attention of one segment's rows over ``buffer`` (new rows written)."""
    count, groups = qkv.shape[0], shape.heads // shape.kv_heads
    query = qkv[:, : shape.heads * shape.dim].double().view(count, shape.heads, shape.dim)
    keys, values = buffer[0, 0].double(), buffer[1, 0].double()
    out = torch.empty(count, shape.heads, shape.dim, dtype=torch.float64)
    for i in range(count):
        position = at + i
        first = 0 if window is None else max(0, position - window + 1)
        for head in range(shape.heads):
            kv = head // groups
            scores = keys[kv, first : position + 1] @ query[i, head] / math.sqrt(shape.dim)
            out[i, head] = torch.softmax(scores, dim=0) @ values[kv, first : position + 1]
    return out.reshape(count, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=repr)
@pytest.mark.parametrize("window", [None, 5])
def test_matches_float64_attention_and_writes_the_cache(
    dtype: torch.dtype, shape: Shape, window: int | None
) -> None:
    spans = [(0, 7), (40, 1), (17, 16), (99, 3)]
    qkv = frame_rows(shape, sum(c for _, c in spans), dtype, seed=3)
    buffers = [cache_for(shape, dtype, seed) for seed in range(len(spans))]
    before = [b.clone() for b in buffers]
    segments = [(b, at, count) for b, (at, count) in zip(buffers, spans, strict=True)]
    out = run(shape, qkv, segments, window)
    assert out.dtype == dtype and out.shape == (qkv.shape[0], shape.heads * shape.dim)
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    row = 0
    for buffer, old, (at, count) in zip(buffers, before, spans, strict=True):
        rows = qkv[row : row + count]
        new = rows[:, shape.heads * shape.dim :].view(count, 2, 1, shape.kv_heads, shape.dim)
        old[:, :, :, at : at + count] = new.permute(1, 2, 3, 0, 4)
        assert torch.equal(buffer, old)  # exactly the new keys/values, nothing else
        expected = reference(shape, rows, buffer, at, window)
        got = out[row : row + count].double()
        scale = expected.abs().max().clamp(min=1.0)
        assert (got - expected).abs().max() <= tolerance * scale
        row += count


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 6])
def test_a_row_is_the_same_alone_in_a_window_and_beside_other_sessions(
    threads: int, dtype: torch.dtype, window: int | None
) -> None:
    """A session's rows prefilled as one chunk equal the same rows run one at a time
    (decode steps), and a batch of several sessions (chunks, windows, decode rows)
    gives each row what it gets alone, bit for bit."""
    shape = Shape(9, 3, 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        qkv = frame_rows(shape, 60, dtype, seed=5)
        chunked = cache_for(shape, dtype, seed=1)
        whole = run(shape, qkv[:40], [(chunked, 10, 40)], window)
        stepped = cache_for(shape, dtype, seed=1)
        alone = torch.cat(
            [run(shape, qkv[i : i + 1].clone(), [(stepped, 10 + i, 1)], window) for i in range(40)]
        )
        assert torch.equal(whole, alone)
        assert torch.equal(chunked, stepped)
        # The same rows beside other sessions, in another order and other cuts.
        others = [cache_for(shape, dtype, seed=s) for s in (7, 8)]
        mixed_cache = cache_for(shape, dtype, seed=1)
        parts = torch.cat([qkv[40:45], qkv[:25], qkv[45:46], qkv[25:40], qkv[46:60]])
        mixed = run(
            shape,
            parts,
            [(others[0], 3, 5), (mixed_cache, 10, 25), (others[1], 120, 1), (mixed_cache, 35, 15),
             (others[0], 8, 14)],
            window,
        )  # fmt: skip
        assert torch.equal(torch.cat([mixed[5:30], mixed[31:46]]), whole)
    finally:
        torch.set_num_threads(previous)


def test_a_large_frame_splits_over_threads_with_the_same_result() -> None:
    shape = Shape(9, 3, 64)
    qkv = frame_rows(shape, 128, torch.bfloat16, seed=9)
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(run(shape, qkv, [(cache_for(shape, torch.bfloat16, 2), 0, 128)]))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


def test_declines_what_it_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = Shape(4, 2, 16)
    qkv = frame_rows(shape, 2, torch.float32, seed=0)
    assert native_attention.usable(qkv, 16, 2)
    assert not native_attention.usable(qkv.double(), 16, 2)
    assert not native_attention.usable(qkv, 512, 2)
    assert not native_attention.usable(qkv, 16, 128)
    # A cache in another dtype than the frame: the caller keeps torch's attention.
    part = SegmentRows(Cache(cache_for(shape, torch.bfloat16, 0)), 0, 0, 2, (None, None))  # type: ignore[arg-type]
    assert native_attention.attend(qkv, [part], 0, 4, 2, 16, 0.25, False) is None
    monkeypatch.setattr(qkernels, "MODE", "torch")
    assert not native_attention.usable(qkv, 16, 2)
