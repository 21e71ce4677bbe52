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
  the same result for any row count from 2 to 64 at any offset, but a one-row call
  takes a matrix-vector kernel that sums in another order, and with several
  threads MKL splits some shapes differently from 17 rows on (float32, K = 1536).
  ``rows`` therefore never calls them with one row (it adds a copy of that row) and
  never with more than ``row_tile()`` rows (it cuts larger calls into tiles), so
  every row goes through the same kernel.
- **Attention** (``attention``). A query at position ``p`` always attends over the
  keys ``0 .. pad(p)``, ``pad`` rounding ``p + 1`` up to a multiple of ``KEY_BLOCK``
  (positions past ``p`` masked; the cache holds finite numbers there). Each query
  row is its own batch entry of torch's SDPA kernel, with the same entry shape as a
  decode step (its heads sharing a key/value head are the entry's rows); rows of a
  verify window or prefill chunk sharing a padded range run as one call over the
  broadcast keys. The kernel computes every entry alike and splits its work over
  threads by entry, not inside one, so a row's result is the decode step's.
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
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def rows(matmul: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """``matmul(inputs)`` for ``inputs`` ``[T, K]`` with every call 2..``row_tile()``
    rows: a lone row is doubled, a long input is cut into tiles."""
    count = inputs.shape[0]
    if count == 1:
        return matmul(inputs.expand(2, -1).contiguous())[:1]
    size = row_tile()
    if count <= size:
        return matmul(inputs)
    tiles = []
    for first in range(0, count, size):
        tile = inputs[first : first + size]
        if tile.shape[0] == 1:
            tiles.append(matmul(tile.expand(2, -1).contiguous())[:1])
        else:
            tiles.append(matmul(tile))
    return torch.cat(tiles)


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
    entries; the kernel computes every entry alike."""
    count, heads, dim = query.shape
    kv_heads = keys.shape[0]
    grouped = query.view(count, kv_heads, groups, dim)
    if count == 1:
        return _attend(grouped, keys, values, pos_start, scaling, window).reshape(1, -1)
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
        out[row:last] = _attend(grouped[row:last], keys, values, pos_start + row, scaling, window)
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
    return F.scaled_dot_product_attention(
        query, held_keys, held_values, attn_mask=mask, scale=scaling
    )


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
