"""Linear layers and embeddings over dense or quantised weights (see mesh/quant.py).

``LinearSpec`` is a weight as it comes out of a package: a dense tensor, or the
parts of a quantised one, plus an optional bias. ``fuse`` stacks several specs that
read the same input (q/k/v, gate/up) into one, so a decode step runs one matmul
where the checkpoint has three. ``build_linear`` turns a spec into a callable on a
device: dense weights run ``F.linear``; int4 runs torch's int4 weight-only kernel
(``_weight_int4pack_mm_for_cpu`` on CPU, ``_weight_int4pack_mm`` on CUDA) with
bfloat16 activations; int8 runs ``_weight_int8pack_mm`` where torch has it (CPU,
and CUDA in recent builds; elsewhere the weight is cast per call).

torch's CPU weight-only kernels cost about one single-row call per row, so on CPU
a call with many rows (a prefill chunk, a large batch) instead dequantises the
weight to float32 for that call and runs one float32 GEMM, which grows about half
as fast with rows (see ``GEMM_ROWS``; benchmarks/quant_rows_bench.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mesh import quant
from mesh.runtime import invariant, qkernels
from mesh.runtime.qkernels import NativeInt4Linear, NativeInt8Linear

logger = logging.getLogger(__name__)

# The int4 kernels take activations, scales and zeros in this dtype.
INT4_ACTIVATION_DTYPE = torch.bfloat16
# What a torch without oneDNN's linear ops, or one refusing a weight, raises.
ONEDNN_ERRORS = (RuntimeError, AttributeError, NotImplementedError)
# The CUDA int4 kernel's tile of the packed layout (K must be a multiple of 16 * this).
CUDA_INNER_K_TILES = 8
# From this many rows on, a CPU int4 / int8 linear dequantises its weight to float32
# per call, a tile of outputs at a time, and runs float32 GEMMs instead of torch's
# weight-only kernel (whose cost is about one single-row call per row). Measured with
# benchmarks/quant_rows_bench.py (2-core AVX-512 VM, 1 thread, torch 2.13, the
# SmolLM2-135M shapes and 2048x8192) against the kernel alone: at 32 rows no gain;
# at 64 int4 0.9-1.03x, int8 1.05-1.6x; at 128 1.25-1.65x; at 512 1.7-2.0x.
# Rows on either side of the threshold are computed by different kernels, so a row's
# result can change in the last bfloat16 bit with the number of rows in the call.
GEMM_ROWS = 64
# Off by default: with the GEMM path a row's result depends on how many rows share
# its call, so an int4 / int8 answer would change with the load and after a failover
# re-prefill (measured: 32 of 80 chaos streams differed from their no-fault output
# on the int4 package with it on). `mesh-stage join --quantised-gemm` turns it on
# for faster long prefills, and row-invariant arithmetic off (mesh/runtime/invariant.py).
QUANTISED_GEMM = False
# Outputs dequantised at once: a float32 tile of about 1 MiB stays in cache (whole
# weights dequantised at once run 2-3x slower per element once they do not).
GEMM_TILE_BYTES = 1 << 20


@dataclass(frozen=True)
class LinearSpec:
    """A weight ``[N, K]`` as stored: dense ``weight`` or quantised ``parts`` of ``kind``."""

    out_features: int
    in_features: int
    kind: str = "dense"  # dense | int4 | int8
    weight: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] | None = None
    bias: torch.Tensor | None = None


def permute_rows(spec: LinearSpec, order: torch.Tensor) -> LinearSpec:
    """``spec`` with its output rows in ``order`` (each quantised row keeps its own
    codes and scales: the parts are permuted row by row too)."""
    weight = None if spec.weight is None else spec.weight[order]
    parts = None
    if spec.parts is not None:
        parts = {name: part[order] for name, part in spec.parts.items()}
    bias = None if spec.bias is None else spec.bias[order]
    return LinearSpec(spec.out_features, spec.in_features, spec.kind, weight, parts, bias)


def fuse(specs: list[LinearSpec]) -> LinearSpec:
    """One spec whose outputs are the concatenated outputs of ``specs`` (same input)."""
    first = specs[0]
    if any(s.kind != first.kind or s.in_features != first.in_features for s in specs):
        raise ValueError("only weights of one kind and input size can be fused")
    out = sum(s.out_features for s in specs)
    bias = None
    present = [s.bias for s in specs if s.bias is not None]
    if present:
        # A part without a bias adds zeros (Qwen2 has q/k/v biases, others none).
        bias = torch.cat(
            [s.bias if s.bias is not None else present[0].new_zeros(s.out_features) for s in specs]
        )
    if first.kind == "dense":
        weight = torch.cat([s.weight for s in specs])  # type: ignore[misc]
        return LinearSpec(out, first.in_features, "dense", weight=weight, bias=bias)
    parts = {key: torch.cat([s.parts[key] for s in specs]) for key in first.parts}  # type: ignore[index, union-attr]
    return LinearSpec(out, first.in_features, first.kind, parts=parts, bias=bias)


# Row counts of the row-invariant CPU kernels, measured once per kernel kind, dtype,
# thread count and weight shape (invariant.probe_counts).
_ROW_COUNTS: dict[tuple, tuple[int, ...]] = {}


def _row_counts(
    kind: str,
    weight_shape: tuple[int, int],
    matmul: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> tuple[int, ...]:
    """The row counts ``matmul`` (a ``kind`` linear of ``weight_shape``) is called
    with under row invariance: measured on its first call, kept for every linear of
    its kind, dtype, shape and thread count."""
    threads = torch.get_num_threads()
    key = (kind, dtype, threads, tuple(weight_shape))
    counts = _ROW_COUNTS.get(key)
    if counts is None:
        counts = invariant.probe_counts(matmul, weight_shape[-1], dtype)
        _ROW_COUNTS[key] = counts
        logger.info(
            "row-invariant %s %s GEMMs %s, %d thread(s): row counts %s",
            kind,
            dtype,
            tuple(weight_shape),
            threads,
            counts,
        )
    return counts


class DenseLinear:
    """``F.linear`` over a plain weight; ``tiled``: every call 2..n rows, so a row's
    result does not depend on its neighbours (mesh/runtime/invariant.py)."""

    __slots__ = ("weight", "bias", "tiled")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, tiled: bool = False
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.tiled = tiled

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.tiled and inputs.dim() == 2:
            shape = (self.weight.shape[0], self.weight.shape[1])
            counts = _row_counts("dense", shape, self._linear, self.weight.dtype)
            return invariant.rows(self._linear, inputs, counts)
        return F.linear(inputs, self.weight, self.bias)

    def _linear(self, inputs: torch.Tensor) -> torch.Tensor:
        return F.linear(inputs, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


class PackedLinear:
    """A dense weight reordered once into oneDNN's blocked layout (CPU), multiplied
    with oneDNN's linear kernel: on a 2-core AVX-512 VM about 1.7x the one-row speed of
    ``F.linear`` in bfloat16; ``_prefers_packed`` says where it is used. ``tiled`` as
    in ``DenseLinear``."""

    __slots__ = ("weight", "bias", "nbytes", "tiled", "in_features", "dtype")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, tiled: bool = False
    ) -> None:
        self.in_features = weight.shape[1]
        self.dtype = weight.dtype
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = bias
        self.tiled = tiled
        self.nbytes = weight.numel() * weight.element_size()
        # Fail here, not on the first request, where the kernel cannot take it.
        self(torch.zeros(1, weight.shape[1], dtype=weight.dtype))

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.tiled and inputs.dim() == 2:
            shape = (self.nbytes // self.dtype.itemsize // self.in_features, self.in_features)
            counts = _row_counts("packed", shape, self._linear, self.dtype)
            return invariant.rows(self._linear, inputs, counts)
        return self._linear(inputs)

    def _linear(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(inputs, self.weight, self.bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


def unpacked(linear: Linear) -> Linear:
    """``linear`` with a plain weight (``DenseLinear``) if it is a ``PackedLinear``."""
    if not isinstance(linear, PackedLinear):
        return linear
    weight = linear.weight.to_dense()
    return DenseLinear(dense_weight(weight, weight.device, weight.dtype), linear.bias, linear.tiled)


def packed(linear: Linear) -> Linear:
    """``linear`` as a ``PackedLinear`` if it is a ``DenseLinear`` that ``build_linear``
    would have packed."""
    if not isinstance(linear, DenseLinear):
        return linear
    weight = linear.weight
    if not _packable(weight.device, weight.dtype) or not _prefers_packed(
        weight.shape[0], weight.shape[1], weight.dtype
    ):
        return linear
    try:
        return PackedLinear(weight.contiguous(), linear.bias, linear.tiled)
    except ONEDNN_ERRORS:
        return linear


def _packable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


class Int4Linear:
    """Group-wise int4 weights in the device kernel's packed layout."""

    __slots__ = ("packed", "scales_zeros", "group", "out_features", "bias", "_mm", "_block")

    def __init__(self, spec: LinearSpec, device: torch.device, dtype: torch.dtype) -> None:
        parts = spec.parts or {}
        codes_packed = parts["qweight"].to(device)
        scales = parts["scales"].to(device=device, dtype=torch.float32)
        mins = parts["mins"].to(device=device, dtype=torch.float32)
        self.group = spec.in_features // scales.shape[1]
        self.out_features = spec.out_features
        # The kernels compute (code - 8) * scale + zero, so zero = min + 8 * scale.
        zeros = mins + 8 * scales
        self.scales_zeros = (torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()).to(
            INT4_ACTIVATION_DTYPE
        )
        if device.type == "cpu":
            codes = quant.unpack_int4(codes_packed)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            self._block = cpu_int4_block(self.packed, codes)
        else:
            tile = 16 * CUDA_INNER_K_TILES
            if spec.in_features % tile or spec.out_features % 8:
                # The packed layout has whole tiles only; a partial one would be cut off.
                raise RuntimeError(
                    f"the CUDA int4 layout needs in_features % {tile} == 0 and "
                    "out_features % 8 == 0"
                )
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                codes_packed.contiguous(), CUDA_INNER_K_TILES
            )
            self._mm = torch.ops.aten._weight_int4pack_mm
            self._block = 0
        self.bias = None if spec.bias is None else spec.bias.to(device=device, dtype=dtype)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[T, in_features]`` (the runtime's layout) or any ``[..., in]``."""
        flat = inputs if inputs.dim() == 2 else inputs.reshape(-1, inputs.shape[-1])
        if flat.dtype != INT4_ACTIVATION_DTYPE:
            flat = flat.to(INT4_ACTIVATION_DTYPE)
        if QUANTISED_GEMM and self._block and flat.shape[0] >= GEMM_ROWS:
            out = self.gemm(flat)
        else:
            out = self._mm(flat, self.packed, self.group, self.scales_zeros)
        if out.dtype != inputs.dtype:
            out = out.to(inputs.dtype)
        if inputs.dim() != 2:
            out = out.reshape(*inputs.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def gemm(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (bfloat16, as the kernel takes it) times the weight in float32
        GEMMs over tiles of outputs, rounded to bfloat16 as the kernel returns it."""
        inputs = flat.to(torch.float32)
        tile = _tile_columns(flat.shape[1], self._block)
        outs = [
            torch.mm(inputs, self.dequantized_t(first, min(first + tile, self.out_features)))
            for first in range(0, self.out_features, tile)
        ]
        return torch.cat(outs, dim=1).to(INT4_ACTIVATION_DTYPE)

    def dequantized_t(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Outputs ``first:last`` of the weight, transposed: ``[in_features, last -
        first]`` float32, decoded from the CPU kernel's packed layout (see
        ``cpu_int4_block``; ``first`` and ``last`` are multiples of its block). A
        temporary of one call, never kept."""
        last = self.out_features if last is None else last
        block, half = self._block, self._block // 2
        k = self.packed.shape[1] * 2
        blocks = self.packed.view(-1, k, half)[first // block : last // block]
        weight = torch.empty(k, blocks.shape[0], block)
        weight[..., :half].copy_((blocks & 0x0F).transpose(0, 1))
        weight[..., half:].copy_((blocks >> 4).transpose(0, 1))
        scales = self.scales_zeros[:, first:last, 0].to(torch.float32)  # [K / group, cols]
        # The kernel computes (code - 8) * scale + zero; here the codes are 0..15.
        zeros = self.scales_zeros[:, first:last, 1].to(torch.float32) - 8 * scales
        grouped = weight.view(scales.shape[0], self.group, last - first)
        torch.addcmul(zeros.unsqueeze(1), grouped, scales.unsqueeze(1), out=grouped)
        return weight.view(k, last - first)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales_zeros, self.bias) if t is not None]


def cpu_int4_block(packed: torch.Tensor, codes: torch.Tensor) -> int:
    """The output block of torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``
    of ``codes`` ``[N, K]``), or 0 if it is not one ``Int4Linear.dequantized_t`` reads.

    The layout depends on the CPU kernel torch picked: each block of ``block`` outputs
    is stored ``[K, block / 2]`` bytes, the low nibbles holding outputs ``0 .. block/2``
    and the high nibbles the rest (AVX-512: 64 outputs, AVX2: 32). Each candidate is
    checked against the codes, so another layout (a partial last block, a newer
    torch) keeps the weight on the kernel alone.
    """
    rows, cols = codes.shape
    for block in (64, 32):
        if rows % block:
            continue
        blocks = packed.reshape(rows // block, cols, block // 2)
        decoded = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1)  # [N/block, K, block]
        if torch.equal(decoded.transpose(1, 2).reshape(rows, cols).to(codes.dtype), codes):
            return block
    logger.info(
        "unrecognised CPU int4 layout for a [%s, %s] weight: every row count uses the kernel",
        rows,
        cols,
    )
    return 0


class Int8Linear:
    """Per-channel int8 weights; torch's int8 weight-only kernel where it exists."""

    __slots__ = ("qweight", "scales", "out_features", "bias", "_kernel", "_gemm")

    def __init__(self, spec: LinearSpec, device: torch.device, dtype: torch.dtype) -> None:
        parts = spec.parts or {}
        # A fresh, aligned copy: the CPU kernel faults on int8 data that is not
        # 64-byte aligned, as a tensor read out of a safetensors file can be.
        self.qweight = parts["qweight"].to(device).clone(memory_format=torch.contiguous_format)
        self.scales = parts["scales"].to(device=device, dtype=dtype)
        self.out_features = spec.out_features
        self.bias = None if spec.bias is None else spec.bias.to(device=device, dtype=dtype)
        self._kernel = device.type == "cpu" or self._kernel_runs(dtype)
        self._gemm = device.type == "cpu"

    def _kernel_runs(self, dtype: torch.dtype) -> bool:
        """Whether torch's int8 kernel takes this weight on its (non-CPU) device; recent
        CUDA builds have one. Otherwise each call multiplies by the cast weight."""
        probe = torch.zeros(1, self.qweight.shape[1], dtype=dtype, device=self.qweight.device)
        try:
            torch.ops.aten._weight_int8pack_mm(probe, self.qweight, self.scales)
        except (RuntimeError, NotImplementedError) as error:
            logger.warning(
                "no int8 weight-only kernel for a %s weight on %s (%s); multiplying by "
                "the weight cast to %s on every call",
                tuple(self.qweight.shape),
                self.qweight.device,
                str(error).splitlines()[0] if str(error) else type(error).__name__,
                dtype,
            )
            return False
        return True

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[T, in_features]`` (the runtime's layout) or any ``[..., in]``."""
        flat = inputs if inputs.dim() == 2 else inputs.reshape(-1, inputs.shape[-1])
        scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
        if QUANTISED_GEMM and self._gemm and flat.shape[0] >= GEMM_ROWS:
            out = self.gemm(flat, scales)
        elif self._kernel:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, scales)
        else:
            out = F.linear(flat, self.qweight.to(flat.dtype)) * scales
        if inputs.dim() != 2:
            out = out.reshape(*inputs.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def gemm(self, flat: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``flat`` times the weight in float32 GEMMs over tiles of outputs (each
        dequantised for this call only), in ``flat``'s dtype as the kernel returns it."""
        inputs = flat.to(torch.float32)
        tile = _tile_columns(flat.shape[1], 1)
        outs = [
            F.linear(inputs, self.qweight[first : first + tile].to(torch.float32))
            * scales[first : first + tile]
            for first in range(0, self.out_features, tile)
        ]
        return torch.cat(outs, dim=1).to(flat.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.bias) if t is not None]


def _tile_columns(in_features: int, block: int) -> int:
    """Outputs per dequantised tile: about ``GEMM_TILE_BYTES`` of float32, whole blocks."""
    columns = GEMM_TILE_BYTES // (4 * in_features)
    return max(block, columns - columns % block)


Linear = DenseLinear | PackedLinear | Int4Linear | Int8Linear | NativeInt4Linear | NativeInt8Linear


def dense_weight(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` ``[N, K]`` on ``device`` in ``dtype``, laid out for ``F.linear`` with
    one row (where a weight is not packed for oneDNN: a tied embedding and LM head on
    one stage, or a CPU without oneDNN).

    On CPU, float32 weights are stored ``[K, N]`` and returned as an ``[N, K]`` view:
    torch's float32 matrix-vector product reads that layout faster (measured on a
    2-core AVX-512 VM: 1.2x on a whole float32 decode step, 1.7x on SmolLM2's LM
    head; prefill unchanged). bfloat16 is faster in the plain layout, kept as is.
    """
    weight = weight.to(device=device, dtype=dtype)
    if device.type == "cpu" and dtype == torch.float32:
        return weight.t().contiguous().t()
    return weight.contiguous()


def _prefers_packed(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed layout beats a plain matmul for this weight on CPU.

    Measured on a 2-core AVX-512 VM, 1 thread (SmolLM2's shapes): in bfloat16 the
    packed kernel is 1.2-2x faster at 1-32 rows and gives each row the same result
    whatever the row count. In float32 a plain matmul over the ``[K, N]`` layout
    (``dense_weight``) is faster at one row (58 vs 74 us for 960x576, 270 vs 303 us for
    3072x576) and grows far slower with rows (1.3-1.5x one row's time at 8 rows
    against 2.2x packed), so decoder layers take it; the LM head's wide shape
    (49152x576) is faster packed from a few rows on (13.3 vs 15.8 ms at 8 rows).
    """
    if dtype == torch.bfloat16:
        return True
    return out_features >= 8 * in_features


def build_linear(
    spec: LinearSpec, device: torch.device, dtype: torch.dtype, tiled: bool = False
) -> Linear:
    """The callable for ``spec`` on ``device``; dense weights are cast to ``dtype`` and
    with ``tiled`` called in row tiles (mesh/runtime/invariant.py; the quantised
    kernels take rows one by one already)."""
    if spec.kind == "dense":
        bias = None if spec.bias is None else spec.bias.to(device=device, dtype=dtype)
        if _packable(device, dtype) and _prefers_packed(spec.out_features, spec.in_features, dtype):
            try:
                plain = spec.weight.to(device=device, dtype=dtype).contiguous()  # type: ignore[union-attr]
                return PackedLinear(plain, bias, tiled)
            except ONEDNN_ERRORS as error:
                logger.warning("oneDNN cannot take a %s weight (%s); using F.linear", dtype, error)
        return DenseLinear(dense_weight(spec.weight, device, dtype), bias, tiled)  # type: ignore[arg-type]
    if spec.kind in ("int4", "int8") and device.type == "cpu":
        group = None
        if spec.kind == "int4":
            group = spec.in_features // (spec.parts or {})["scales"].shape[1]
        if qkernels.usable(spec.kind, spec.in_features, group):
            native_type = NativeInt4Linear if spec.kind == "int4" else NativeInt8Linear
            return native_type(spec, device, dtype)
    if spec.kind == "int8":
        return Int8Linear(spec, device, dtype)
    if spec.kind == "int4":
        try:
            return Int4Linear(spec, device, dtype)
        except RuntimeError as error:
            if device.type == "cpu":
                raise
            logger.warning(
                "the int4 kernel cannot take a [%s, %s] weight on %s (%s); holding it "
                "dequantised in %s instead",
                spec.out_features,
                spec.in_features,
                device,
                error,
                dtype,
            )
            weight = quant.dequantize_int4(spec.parts or {}, dtype)
            return build_linear(
                LinearSpec(spec.out_features, spec.in_features, weight=weight, bias=spec.bias),
                device,
                dtype,
                tiled,
            )
    raise ValueError(f"unknown linear kind {spec.kind!r}")


class Embedding:
    """Token embedding lookup over a dense table or a group-wise int8 one; ``scale``
    multiplies the rows (Gemma's square root of the hidden size, rounded to the
    compute dtype as Gemma does)."""

    __slots__ = ("weight", "parts", "dtype", "scale")

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        weight: torch.Tensor | None = None,
        parts: dict[str, torch.Tensor] | None = None,
        scale: float | None = None,
    ) -> None:
        self.dtype = dtype
        self.scale = None if scale is None else torch.tensor(scale, dtype=dtype, device=device)
        self.weight = None if weight is None else weight.to(device=device, dtype=dtype)
        self.parts = None if parts is None else {k: v.to(device) for k, v in parts.items()}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            rows = F.embedding(ids, self.weight)
        else:
            flat = ids.reshape(-1)
            rows = quant.dequantize_int8_groups(self.parts or {}, self.dtype, flat)
            rows = rows.reshape(*ids.shape, -1)
        return rows if self.scale is None else rows * self.scale

    def tensors(self) -> list[torch.Tensor]:
        if self.weight is not None:
            return [self.weight]
        return list((self.parts or {}).values())


def distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors, counting storage shared by several of them once."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.is_mkldnn:  # an opaque oneDNN layout (PackedLinear): no shared storage
            total += tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
