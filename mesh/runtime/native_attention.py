"""Row-invariant attention on the stage's own CPU kernel (kernels/attend.c, built
and loaded by mesh/runtime/native.py): every segment of a frame in one call per
layer, each query row over its own session's cache.

Each (query row, head) goes through the same float32 operations whatever the frame
holds: its keys ``lo .. p`` (``lo`` = 0, or the sliding window's first), the dot
products over the head dimension in a fixed tree, a softmax with a polynomial exp,
the weighted sum of values in order of position. No padding, no mask, no per
segment Python: the kernel also writes the segment's new keys and values into its
cache. It replaces torch's SDPA called once per segment and layer over a key range
padded to 64 (mesh/runtime/invariant.py), whose cost is mostly the calls: a stage
step of 8 decode rows took 0.81x the time (``benchmarks/step_bench.py``,
docs/benchmarks.md). Used under row-invariant arithmetic on CPU where the kernels
load and ``--quantised-kernel`` is not ``torch``.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from mesh.runtime import native, qkernels

if TYPE_CHECKING:
    from mesh.runtime.block import SegmentRows

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The kernel's limits (kernels/attend.c): 16 lanes of 16 per head, 64 query heads
# per key/value head.
MAX_HEAD_DIM = 256
MAX_GROUPS = 64


def usable(qkv: torch.Tensor, head_dim: int, groups: int) -> bool:
    """Whether the kernel can take a frame's q/k/v rows ``qkv`` (``groups`` query
    heads per key/value head) here."""
    return (
        qkernels.MODE != "torch"
        and qkv.device.type == "cpu"
        and qkv.dtype in _DTYPES
        and qkv.dim() == 2
        and qkv.stride(1) == 1
        and head_dim <= MAX_HEAD_DIM
        and groups <= MAX_GROUPS
        and native.library() is not None
    )


def attend(
    qkv: torch.Tensor,
    segments: list[SegmentRows],
    layer_index: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    sliding: bool,
) -> torch.Tensor | None:
    """Write each segment's new keys and values (columns ``heads * head_dim ..`` of
    ``qkv``, rotated) into its cache and return the attention output ``[T, heads *
    head_dim]``; ``None`` where a cache is not in the layout the kernel reads."""
    lib = native.library()
    assert lib is not None
    rows: list[int] = []
    for part in segments:
        kv = part.cache.layer(layer_index)
        if kv.dtype != qkv.dtype or not kv.is_contiguous() or kv.device != qkv.device:
            return None
        window = part.window if sliding and part.window else 0
        rows += [part.row, part.at, part.count, window, kv.shape[-2], kv.data_ptr()]
    table = array("q", rows)  # int64, as the kernel reads it; cheaper than a tensor
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype)
    status = lib.mesh_attend(
        qkv.data_ptr(), qkv.stride(0), _DTYPES[qkv.dtype], heads, kv_heads, head_dim,
        scaling, table.buffer_info()[0], len(segments), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == -1:
        raise MemoryError("the attention kernel could not allocate its score buffer")
    if status != 0:
        raise ValueError(f"the attention kernel refused the frame's shape (status {status})")
    return out
