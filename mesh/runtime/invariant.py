"""Row-invariant arithmetic: a row's result depends on that row alone.

A token's hidden state and logits must come out bit-identical whether the token runs
alone (a decode step), inside a verify window, inside a batch of other sessions'
rows, or inside a prefill chunk (a failover replay, a prompt cut differently under
load). Otherwise greedy text changes with the load and with speculation, because
near-ties flip. Every reduction a row goes through must therefore have the same
order whatever the other rows are. On CPU it holds as follows (each kernel property
below is checked by ``tests/unit/test_row_invariance.py``, 1 and 2 threads):

- **Linears.** torch's int4 and int8 weight-only kernels loop over one row at a
  time: already invariant. The float32 / bfloat16 / float16 GEMMs (MKL, oneDNN) give every row
  the same result for some row counts and not for others, and which ones depends
  on the CPU and the thread count (one VM measured: every count 2..64 alike, a
  one-row call summing in another order; another: 1-3 rows unlike 4 and more, and
  with 2 threads 5-7 and 9-11 too). ``probe_counts`` measures, once per kernel,
  dtype and thread count, which counts give every row a full tile's result;
  ``rows`` then calls the kernel only with those counts (padding with zero rows up
  to the next one) and never with more than ``row_tile()`` rows (it cuts larger
  calls into tiles), so every row goes through the same kernel.
- **Attention** (``attention``). A query at position ``p`` always attends over the
  keys ``0 .. pad(p)``, ``pad`` rounding ``p + 1`` up to a multiple of ``KEY_BLOCK``
  (positions past ``p`` masked; the cache holds finite numbers there). Each query
  row is its own batch entry of torch's SDPA kernel, with the same entry shape as a
  decode step (its heads sharing a key/value head are the entry's rows); rows of a
  verify window or prefill chunk sharing a padded range run as one call over the
  broadcast keys. The kernel computes every entry alike and splits its work over
  threads by entry, not inside one, so a row's result is the decode step's. In
  float32 the same entries go through two batched matmuls and a softmax instead of
  SDPA, whose float32 CPU kernel gave an entry other results in a batch than alone
  with 2 threads on one VM measured. Where the stage's own CPU kernels load
  (mesh/runtime/native_attention.py), every row of a frame goes through one kernel
  call per layer instead, each (row, head) over exactly its own keys in one fixed
  order of operations: invariant by construction, without padding or masks.
- Norms, rotary, activations and residuals are per row already; the embedding is a
  lookup.

What is not covered: the quantised GEMM path (``mesh-stage join --quantised-gemm``,
a different kernel from 64 rows on, so it turns invariance off), torch.compile'd
and CUDA-graph decode steps (other kernels), and CUDA devices, whose cuBLAS and
attention kernels pick their reduction split by shape: the same structure carries
there (fixed row tiles, one attention entry per row over a padded key range,
kernels with a fixed split and no split-K), which is not built yet.

The price (benchmarks/invariance_bench.py, docs/benchmarks.md) is small where the
linears are quantised (their kernels already take rows one by one) and larger for
dense weights (a single row runs as two). ``MODE`` (``mesh-stage join
--row-invariant``) chooses: ``auto`` (the default) turns it on for packages with
int4 / int8 linears, ``on`` and ``off`` for every package; off means the previous
kernels (one SDPA call per segment, untiled GEMMs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MODE = "auto"
# Most rows a float32 / bfloat16 GEMM is called with: every row count 2..64 gives
# a row the same result with one thread on the CPU measured, 2..16 with more.
ROW_TILE = 64
ROW_TILE_THREADED = 16
# A query attends over its position rounded up to a multiple of this (the KV
# buffers are allocated in multiples of it, mesh/runtime/sessions.py).
KEY_BLOCK = 64


def chosen(device: torch.device, quantised: bool) -> bool:
    """Whether a runtime on ``device`` whose decoder linears are ``quantised`` (int4 /
    int8) computes row-invariantly under ``MODE`` (CPU only, see above)."""
    if device.type != "cpu" or MODE == "off":
        return False
    return MODE == "on" or quantised


def row_tile() -> int:
    """The most rows one GEMM call takes under this process's thread count."""
    return ROW_TILE if torch.get_num_threads() == 1 else ROW_TILE_THREADED


def rows(
    matmul: Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """``matmul(inputs)`` for ``inputs`` ``[T, K]`` with every call of a row count in
    ``counts`` (ascending; the last is the tile): a long input is cut into tiles, and
    a call of fewer rows than a count is padded with zero rows up to the next one.
    Without ``counts``, 2..``row_tile()``."""
    if counts is None:
        counts = range(2, row_tile() + 1)
    tile = counts[-1]
    out = []
    for first in range(0, inputs.shape[0], tile):
        part = inputs[first : first + tile]
        size = part.shape[0]
        padded = next(c for c in counts if c >= size)
        if padded > size:
            part = torch.cat([part, part.new_zeros(padded - size, part.shape[1])])
        out.append(matmul(part)[:size])
    return out[0] if len(out) == 1 else torch.cat(out)


# Row counts a probe tries (up to the tile): a call is padded up to the next one
# that gives every row a full tile's result, so at most half its rows are padding.
# One row is never a candidate: a one-row call may take a matrix-vector kernel whose
# difference a probe in bfloat16 can miss.
PROBE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Random tiles a probe compares, at these scales in turn: every disjoint slice of a
# count's rows in each tile is compared with the full tile's rows, up to
# PROBE_SLICES slices per count. Some kernels differ only now and then (float16 with
# 2 threads and 32 inputs, on one VM: 2-row calls in 7% of slices), which a probe
# of one slice per count missed.
PROBE_SCALES = (1.0, 0.1, 8.0)
PROBE_TILES = 8
PROBE_SLICES = 64


def probe_counts(
    matmul: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype
) -> tuple[int, ...]:
    """The row counts (of ``PROBE_COUNTS`` up to ``row_tile()``) whose calls give each
    row the result a full tile gives it, at any place in the tile: which GEMM calls
    ``rows`` may make with this kernel, weight shape and thread count. BLAS libraries
    choose their kernels by row count, shape and CPU (MKL on one 2-core VM: 1-3 rows
    sum in another order than 4 and more; with 2 threads also 5-7 and 9-11), so this
    is measured, not assumed. Returns the default 2..tile, with a warning, where no
    choice of counts helps (a row's result depends on its place in a call)."""
    tile = row_tile()
    gen = torch.Generator().manual_seed(0)
    good = set(c for c in PROBE_COUNTS if c < tile)
    compared = dict.fromkeys(good, 0)
    with torch.no_grad():
        for index in range(PROBE_TILES):
            scale = PROBE_SCALES[index % len(PROBE_SCALES)]
            x = (torch.randn(tile + 5, in_features, generator=gen) * scale).to(dtype)
            full = matmul(x[:tile])
            if not torch.equal(matmul(x[5 : tile + 5])[: tile - 5], full[5:]):
                logger.warning(
                    "row-invariant %s GEMMs are not available on this CPU: a row's "
                    "result depends on its place in a call",
                    dtype,
                )
                return tuple(range(2, tile + 1))
            for count in sorted(good):
                for first in range(0, tile - count + 1, count):
                    if compared[count] >= PROBE_SLICES:
                        break
                    compared[count] += 1
                    end = first + count
                    if not torch.equal(matmul(x[first:end]), full[first:end]):
                        good.discard(count)
                        break
    return (*sorted(good), tile)


def padded_end(position: int) -> int:
    """The keys a query at ``position`` attends over: ``0 .. padded_end``."""
    return (position // KEY_BLOCK + 1) * KEY_BLOCK


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos_start: int,
    scaling: float,
    groups: int,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, D]`` (positions ``pos_start ..``)
    over a session's cache ``keys`` / ``values`` ``[kv_heads, capacity, D]`` (its
    rows up to ``pos_start + T`` written), ``window`` limiting how far back a query
    sees (sliding-window layers). Returns ``[T, heads * D]``, each row computed the
    same way whatever ``T`` and ``pos_start`` are.

    Each query row is its own SDPA batch entry: its ``groups`` heads sharing a
    key/value head are that entry's query rows (the same entry shape as a decode
    step), over the keys ``first_key .. padded_end`` under a boolean mask. Rows
    sharing that key range run as one SDPA call, the keys broadcast over the
    entries; the kernel computes every entry alike. ``softcap`` caps the scores
    (Gemma 2) on the matmul path (``_attend_matmul``) in any dtype."""
    count, heads, dim = query.shape
    kv_heads = keys.shape[0]
    grouped = query.view(count, kv_heads, groups, dim)
    if count == 1:
        return _attend(grouped, keys, values, pos_start, scaling, window, softcap).reshape(1, -1)
    out = torch.empty_like(grouped)
    row = 0
    while row < count:
        # Rows sharing the first and the padded last key attend over one range.
        first_key = _first_key(pos_start + row, window)
        end = padded_end(pos_start + row)
        last = row + 1
        while (
            last < count
            and padded_end(pos_start + last) == end
            and _first_key(pos_start + last, window) == first_key
        ):
            last += 1
        out[row:last] = _attend(
            grouped[row:last], keys, values, pos_start + row, scaling, window, softcap
        )
        row = last
    return out.reshape(count, heads * dim)


def _first_key(position: int, window: int | None) -> int:
    """The first key a query at ``position`` attends over: 0, or with a window the
    start of the key block holding the oldest key it sees."""
    if window is None or position < window:
        return 0
    return (position - window + 1) // KEY_BLOCK * KEY_BLOCK


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    scaling: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``query`` ``[n, kv_heads, groups, D]`` at positions ``position ..``, rows that
    share one key range, over the cache ``keys`` / ``values`` ``[kv_heads, C, D]``."""
    count, kv_heads, _, dim = query.shape
    first_key, end = _first_key(position, window), padded_end(position)
    held_keys = keys[None, :, first_key:end]
    held_values = values[None, :, first_key:end]
    if count > 1:
        shape = (count, kv_heads, end - first_key, dim)
        held_keys, held_values = held_keys.expand(shape), held_values.expand(shape)
    mask = _mask(first_key, end, position, count, window, query.dtype, query.device)
    if query.dtype == torch.float32 or softcap is not None:
        return _attend_matmul(query, held_keys, held_values, mask, scaling, softcap)
    return F.scaled_dot_product_attention(
        query, held_keys, held_values, attn_mask=mask, scale=scaling
    )


def _attend_matmul(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention as two batched matmuls and a softmax (float32): torch's CPU SDPA
    kernel in float32 gave an entry other results in a batch than alone with 2
    threads on one VM measured; batched GEMMs over entries of one shape do not. A
    lone entry runs as two (one entry folds into another GEMM shape). ``softcap``
    caps the scaled scores (``softcap * tanh(scores / softcap)``) before the mask;
    the softmax runs in float32 whatever the input dtype."""
    count, kv_heads, _, dim = query.shape
    lone = count == 1
    if lone:
        query, mask, count = query.expand(2, -1, -1, -1), mask.expand(2, -1, -1, -1), 2
    length = keys.shape[2]
    keys = keys.expand(count, kv_heads, length, dim)
    values = values.expand(count, kv_heads, length, dim)
    scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, values)
    return out[:1] if lone else out


@functools.lru_cache(maxsize=1024)
def _mask(
    first_key: int,
    end: int,
    position: int,
    count: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The additive mask ``[count, 1, 1, end - first_key]`` of ``count`` queries from
    ``position`` (0 where a key is seen, -inf where not). Every layer of a step asks
    for the same ones, so they are kept; nothing writes to them."""
    at = torch.arange(first_key, end, device=device)
    queries = torch.arange(position, position + count, device=device).unsqueeze(1)
    seen = at <= queries
    if window is not None:
        seen &= at > queries - window
    hidden = torch.zeros(seen.shape, dtype=dtype, device=device)
    return hidden.masked_fill_(~seen, float("-inf")).view(count, 1, 1, end - first_key)
