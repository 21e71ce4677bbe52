"""A stage's decoder layers in one call of the stage's own CPU kernels
(kernels/layer.c, built and loaded by mesh/runtime/native.py), for bfloat16 stages
whose linears all run on the quantised kernels (the int4 and int8 packages on an
AVX-512 VNNI CPU).

Between the kernels of a layer the Python path runs torch's element-wise operations
(rotary, residual additions, SiLU and the gate product) and each kernel's call
set-up: about a third of a one-row decode step of the int4 package on a 2-core VM.
The C loop does the same steps with the same rounding (every float32 result to
bfloat16 where torch's bfloat16 operations round it); its SiLU uses its own exp
(relative error about 2e-7 against torch's about 1 ulp), so a rare value may round
to the neighbouring bfloat16. Rows stay independent of each other: a row's result
is the same alone, in a window or beside other sessions' rows.

Which path a stage takes depends only on its layers and dtype, never on the frame,
so a session's rows always go through the same arithmetic.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mesh.runtime import native, native_attention, qkernels
from mesh.runtime.qkernels import NativeInt4Linear, NativeInt8Linear

if TYPE_CHECKING:
    from mesh.runtime.block import DecoderBlock, SegmentRows

_P = ctypes.c_void_p
_I = ctypes.c_int64
# Columns of the segment table mesh_layers reads.
_SEGMENT_COLUMNS = 7


class _Linear(ctypes.Structure):
    _fields_ = [
        ("int8", _I),
        ("packed", _P),
        ("scales", _P),
        ("mins", _P),
        ("n", _I),
        ("k", _I),
        ("group", _I),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _P),
        ("post_norm", _P),
        ("sliding", _I),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("intermediate", _I),
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
    ]


def _is_silu(act: object) -> bool:
    return (
        act is torch.nn.functional.silu
        or isinstance(act, nn.SiLU)
        or (type(act).__name__ == "SiLUActivation")
    )


def _bias(module: NativeInt4Linear | NativeInt8Linear) -> tuple[bool, int | None]:
    """Whether the C loop can add the linear's bias, and its address (None: none)."""
    bias = module.bias
    if bias is None:
        return True, None
    usable = (
        bias.dtype == torch.bfloat16
        and bias.dim() == 1
        and bias.shape[0] == module.out_features
        and bias.is_contiguous()
    )
    return usable, bias.data_ptr()


def _linear(module: object) -> _Linear | None:
    if not isinstance(module, NativeInt4Linear | NativeInt8Linear):
        return None
    usable, bias = _bias(module)
    if not usable:
        return None
    int8 = isinstance(module, NativeInt8Linear)
    return _Linear(
        int(int8),
        module.packed.data_ptr(),
        module.scales.data_ptr(),
        None if int8 else module.mins.data_ptr(),
        module.out_features,
        module.in_features,
        module.in_features if int8 else module.group,
        bias,
    )


def _norm_ok(weight: torch.Tensor, hidden: int) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 1
        and weight.shape[0] == hidden
        and weight.is_contiguous()
    )


class NativeLayers:
    """The stage's layers as the C loop reads them (built by ``native_layers``)."""

    def __init__(self, blocks: Sequence[DecoderBlock], layers: list[_Layer], shape: _Shape):
        self._blocks = list(blocks)  # keeps the weights the descriptors point at alive
        self._layers = (_Layer * len(layers))(*layers)
        self._shape = shape
        self._first_layer = blocks[0].layer_index
        self._widest_k = max(
            layer_part.k
            for layer in layers
            for layer_part in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self._sums_per_k = max(
            max(1, part.k // part.group) if not part.int8 else part.k // qkernels.BLOCK
            for layer in layers
            for part in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self._scratch = threading.local()

    def _scratch_for(self, rows: int) -> torch.Tensor:
        held = getattr(self._scratch, "buffer", None)
        need = int(native.library().mesh_layers_scratch(ctypes.byref(self._shape), rows))
        if held is None or held.numel() < need:
            held = torch.empty(
                max(need, 2 * (0 if held is None else held.numel())), dtype=torch.bfloat16
            )
            self._scratch.buffer = held
        return held

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        parts: Sequence[SegmentRows],
    ) -> torch.Tensor | None:
        """Every layer over the frame's rows (``hidden`` ``[T, H]`` bfloat16, ``cos`` and
        ``sin`` ``[T, 1, D]``); None where a session's cache is not in the layout the
        kernels read (the caller then runs the Python path)."""
        rows = hidden.shape[0]
        if cos.shape[-1] != self._blocks[0].head_dim:
            return None  # rotary on part of each head (GLM): the Python path
        first = self._first_layer
        table: list[int] = []
        for part in parts:
            kv = part.cache.layer(first)
            if kv.dtype != torch.bfloat16 or not kv.is_contiguous():
                return None
            stride = 0
            if len(self._blocks) > 1:
                stride = part.cache.layer(first + 1).data_ptr() - kv.data_ptr()
            window = part.window or 0
            table += [part.row, part.at, part.count, window, kv.shape[-2], kv.data_ptr(), stride]
        out = hidden.to(torch.bfloat16).contiguous().clone()
        cos = cos.reshape(rows, -1).to(torch.bfloat16).contiguous()
        sin = sin.reshape(rows, -1).to(torch.bfloat16).contiguous()
        segments = torch.tensor(table, dtype=torch.int64)
        threads = max(1, torch.get_num_threads())
        sum_count = self._sums_per_k
        work = qkernels.workspace(rows, self._widest_k, sum_count, threads)
        scratch = self._scratch_for(rows)
        status = native.library().mesh_layers(
            self._layers, len(self._blocks), ctypes.byref(self._shape), out.data_ptr(), rows,
            cos.data_ptr(), sin.data_ptr(), segments.data_ptr(), len(parts), scratch.data_ptr(),
            work.codes, work.dscale, work.sums, work.acc, threads,
        )  # fmt: skip
        if status == -1:
            raise MemoryError("the layer kernels could not allocate their buffers")
        if status != 0:
            raise ValueError(f"the attention kernel refused the frame's shape (status {status})")
        return out


def native_layers(blocks: Sequence[DecoderBlock], dtype: torch.dtype) -> NativeLayers | None:
    """The C loop for ``blocks`` where every layer qualifies (bfloat16, row-invariant,
    quantised native linears (with or without bfloat16 biases), SiLU, no q/k norms,
    experts or Gemma's variations), else None."""
    if not blocks or dtype != torch.bfloat16 or qkernels.MODE == "torch":
        return None
    lib = native.library()
    if lib is None or not hasattr(lib, "mesh_layers"):
        return None
    first = blocks[0]
    hidden = first.input_norm.shape[0]
    layers: list[_Layer] = []
    for block in blocks:
        if (
            not block.row_invariant
            or block.experts is not None
            or block.qk_norm is not None
            or block.attn_out_norm is not None
            or block.softcap is not None
            or block.rope_index is not None
            or block.input_norm.dtype != dtype
            or not _is_silu(block.act)
            or block.heads != first.heads
            or block.groups != first.groups
            or block.head_dim != first.head_dim
            or block.head_dim % 2
            or block.head_dim > native_attention.MAX_HEAD_DIM
            or block.groups > native_attention.MAX_GROUPS
            or block.norm_eps != first.norm_eps
            or block.scaling != first.scaling
            or not _norm_ok(block.input_norm, hidden)
            or not _norm_ok(block.post_norm, hidden)
        ):
            return None
        parts = [_linear(m) for m in (block.qkv, block.o, block.gate_up, block.down)]
        if any(part is None for part in parts):
            return None
        layers.append(
            _Layer(
                *parts, block.input_norm.data_ptr(), block.post_norm.data_ptr(), int(block.sliding)
            )
        )
    intermediate = layers[0].down.k
    if any(layer.down.k != intermediate or layer.gate_up.n != 2 * intermediate for layer in layers):
        return None
    shape = _Shape(
        hidden,
        first.heads,
        first.heads // first.groups,
        first.head_dim,
        intermediate,
        first.norm_eps,
        first.scaling,
    )
    return NativeLayers(blocks, layers, shape)
