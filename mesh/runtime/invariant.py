"""Row-invariant arithmetic: a row's result depends on that row alone.

A token's hidden state and logits must come out bit-identical whether the token runs
alone (a decode step), inside a verify window, inside a batch of other sessions'
rows, or inside a prefill chunk (a failover replay, a prompt cut differently under
load). Otherwise greedy text changes with the load and with speculation, because
near-ties flip. Every reduction a row goes through must therefore have the same
order whatever the other rows are. On CPU that holds here by construction:

- **Linears.** torch's int4 and int8 weight-only kernels loop over one row at a
  time: already invariant. The float32 / bfloat16 GEMMs (MKL, oneDNN) give every row
  the same result for any row count from 2 to 64 at any offset, but a one-row call
  takes a matrix-vector kernel that sums in another order, and with several
  threads MKL splits some shapes differently from 17 rows on (float32, K = 1536).
  ``rows`` therefore never calls them with one row (it adds a copy of that row) and
  never with more than ``row_tile()`` rows (it cuts larger calls into tiles), so
  every row goes through the same kernel (checked by
  ``tests/unit/test_row_invariance.py`` for SmolLM2's shapes, 1 and 2 threads).
- **Attention** (``attention``). A query at position ``p`` always attends over the
  keys ``0 .. pad(p)``, ``pad`` rounding ``p + 1`` up to a multiple of ``KEY_BLOCK``
  (the positions past ``p`` are masked; the cache holds finite numbers there), in
  float32. Rows of one segment whose padded range differs run in separate groups.
  Scores come from a batched matmul whose every entry is one query row's heads
  against the keys (one entry shape whatever the row count); the softmax runs per
  row over that fixed length; the value sum runs over chunks of ``VALUE_CHUNK``
  keys added in order (a single long product is split across threads by the BLAS,
  which changes its order with the thread count).
- Norms, rotary, activations and residuals are per row already; the embedding is a
  lookup.

What is not covered: the quantised GEMM path (``mesh-stage join --quantised-gemm``,
a different kernel from 64 rows on, so it turns invariance off), torch.compile'd
and CUDA-graph decode steps (a different kernel for one row), and CUDA devices,
whose cuBLAS kernels pick their reduction split by shape: the same structure
carries there (fixed row tiles, per-row attention entries, fixed key chunks folded
in order), with kernels that fix their split (no split-K), which is not built yet.
``ENABLED`` (``mesh-stage join --no-row-invariant`` clears it) selects the previous
kernels: torch's SDPA and untiled GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ENABLED = True
# Most rows a float32 / bfloat16 GEMM is called with: every row count 2..64 gives
# a row the same result with one thread on the CPU measured, 2..16 with more.
ROW_TILE = 64
ROW_TILE_THREADED = 16
# A query attends over its position rounded up to a multiple of this (the KV
# buffers are allocated in multiples of it, mesh/runtime/sessions.py).
KEY_BLOCK = 64
# The value sum runs over this many keys per matmul, chunks added in order.
VALUE_CHUNK = 512


def applies(device: torch.device) -> bool:
    """Whether row-invariant arithmetic is on for ``device`` (CPU only, see above)."""
    return ENABLED and device.type == "cpu"


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
    sees (sliding-window layers). Returns ``[T, heads * D]`` in ``query``'s dtype,
    each row computed the same way whatever ``T`` and ``pos_start`` are."""
    count, heads, dim = query.shape
    kv_heads = keys.shape[0]
    grouped = query.view(count, kv_heads, groups, dim).to(torch.float32)
    out = torch.empty(count, kv_heads, groups, dim, dtype=torch.float32, device=query.device)
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
            grouped[row:last],
            keys[:, first_key:end],
            values[:, first_key:end],
            pos_start + row,
            first_key,
            scaling,
            window,
        )
        row = last
    return out.reshape(count, heads * dim).to(query.dtype)


def _first_key(position: int, window: int | None) -> int:
    """The first key block a query at ``position`` can see (0 without a window)."""
    if window is None or position < window:
        return 0
    return (position - window + 1) // KEY_BLOCK * KEY_BLOCK


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    first_key: int,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """``query`` ``[n, kv_heads, groups, D]`` float32 at positions ``position ..``
    over ``keys`` / ``values`` ``[kv_heads, L, D]`` (key 0 is ``first_key``)."""
    count, kv_heads, groups, dim = query.shape
    length = keys.shape[1]
    queries = torch.arange(position, position + count, device=query.device).unsqueeze(1)
    at = torch.arange(first_key, first_key + length, device=query.device).unsqueeze(0)
    hidden = at > queries
    if window is not None:
        hidden |= at <= queries - window
    hidden = hidden.unsqueeze(1)  # [n, 1, L]: one row's mask for all of its heads
    keys_t = keys.to(torch.float32).transpose(1, 2)  # [kv_heads, D, L]
    values = values.to(torch.float32)
    out = torch.empty_like(query)
    for head in range(kv_heads):
        # One batch entry per query row: [groups, D] x [D, L], whatever n is.
        heads = query[:, head].contiguous()
        scores = torch.bmm(heads, keys_t[head].expand(count, dim, length))
        scores.mul_(scaling).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        total = None
        for start in range(0, length, VALUE_CHUNK):
            stop = min(start + VALUE_CHUNK, length)
            part = torch.bmm(
                weights[:, :, start:stop].contiguous(),
                values[head, start:stop].expand(count, stop - start, dim),
            )
            total = part if total is None else total.add_(part)
        out[:, head] = total
    return out
