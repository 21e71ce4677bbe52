"""int4 and int8 linears on the stage's own CPU kernels (mesh/runtime/native.py,
kernels/qmatmul.c): activations as two int8 parts per value with a scale per block
of 32 (about 16 bits), exact VNNI integer dot products.

Measured on a 2-core AVX-512 VM, 1 thread (benchmarks/quant_rows_bench.py, every
SmolLM2 shape and a 2048x8192 one): 0.40-0.97x the time of torch's int4 / int8
kernels at one row and 0.34-0.61x at 16 rows, because a weight tile is decoded once
per call rather than once per four rows. Every row is computed alone in
a fixed order, so results do not depend on the other rows of a call (row
invariance holds) nor on the thread count. Activations are rounded to about 16
bits (to within 1/508 of their block's step), finer than the bfloat16 torch's
kernels round them to: a single int8 part, as llama.cpp uses, measured 6x the KL
divergence of torch's kernel on SmolLM2 (docs/benchmarks.md, "The stage's own
kernels").

``MODE`` (``mesh-stage join --quantised-kernel``): ``auto`` uses these kernels
where they build and run, ``native`` requires them (loading fails otherwise),
``torch`` keeps torch's weight-only kernels.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from mesh import quant
from mesh.runtime import native

if TYPE_CHECKING:
    from mesh.runtime.linear import LinearSpec

MODES = ("auto", "native", "torch")
MODE = "auto"
# Activations are quantised in blocks of this many values (the kernel's QBLOCK).
BLOCK = 32
# Work buffers are cut at this alignment (bytes).
_ALIGN = 64


def usable(kind: str, in_features: int, group: int | None = None) -> bool:
    """Whether a ``kind`` weight with ``in_features`` inputs (and int4 ``group``) runs
    on these kernels under ``MODE`` on this machine; with ``MODE`` ``native`` a
    machine without them is an error."""
    if MODE == "torch" or kind not in ("int4", "int8"):
        return False
    shaped = in_features % BLOCK == 0 and (group is None or group % BLOCK == 0)
    if MODE == "native":
        if native.library() is None:
            raise native.KernelUnavailable(
                "--quantised-kernel native: the kernels cannot be built or loaded here "
                "(the log says why); use auto or torch"
            )
        if not shaped:
            raise ValueError(
                f"--quantised-kernel native needs inputs and int4 groups in multiples of "
                f"{BLOCK} (got {in_features} inputs, group {group})"
            )
        return True
    return shaped and native.library() is not None


def _padded(count: int) -> int:
    return -(-count // 16) * 16


def _aligned(count: int) -> int:
    return -(-count // _ALIGN) * _ALIGN


# Call shapes whose buffer pointers a thread remembers (decode steps repeat a few).
_KNOWN_SHAPES = 64


class _Workspace:
    """One call's buffers, cut out of one allocation kept per thread (and grown as
    calls need), so a call allocates nothing but its output; the pointers of recent
    call shapes are remembered."""

    __slots__ = ("codes", "dscale", "sums", "acc")

    _held = threading.local()

    def __init__(self, rows: int, k: int, sum_count: int, threads: int) -> None:
        held = self._held
        key = (rows, k, sum_count, threads)
        known = getattr(held, "known", None)
        if known is not None and key in known:
            self.codes, self.dscale, self.sums, self.acc = known[key]
            return
        # Codes: two parts, each padded to whole 16-row AMX tiles.
        tiles = -(-rows // 16) * 16
        sizes = (
            2 * tiles * k,
            rows * (k // BLOCK) * 4,
            rows * sum_count * 4,
            threads * 2 * rows * 64,
        )
        need = sum(_aligned(size) for size in sizes) + _ALIGN
        buffer = getattr(held, "buffer", None)
        if buffer is None or buffer.numel() < need:
            buffer = torch.empty(need, dtype=torch.uint8)
            held.buffer = buffer
            held.known = known = {}  # pointers into the buffer it replaces are void
        base = buffer.data_ptr()
        offset = (-base) % _ALIGN
        pointers = []
        for size in sizes:
            pointers.append(base + offset)
            offset += _aligned(size)
        self.codes, self.dscale, self.sums, self.acc = pointers
        if known is None:
            held.known = known = {}
        if len(known) >= _KNOWN_SHAPES:
            known.clear()
        known[key] = tuple(pointers)


def workspace(rows: int, k: int, sum_count: int, threads: int) -> _Workspace:
    """Buffers for one call of the kernels on ``rows`` rows of width up to ``k``
    (``sum_count`` sums per row), reused by the calling thread."""
    return _Workspace(rows, k, sum_count, threads)


def _operands(inputs: torch.Tensor, features: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernel's input (float32 or bfloat16, rows contiguous), an output of the
    same dtype, and whether that is bfloat16."""
    flat = inputs if inputs.dim() == 2 else inputs.reshape(-1, inputs.shape[-1])
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.to(torch.float32)
    x = flat.contiguous()
    return x, torch.empty(x.shape[0], features, dtype=x.dtype), x.dtype == torch.bfloat16


def _threads() -> int:
    return max(1, torch.get_num_threads())


class _NativeLinear(ABC):
    """What both native linears share: a call converts the activations, runs the
    kernel (``_multiply``) into a new output, and adds the bias."""

    __slots__ = ()
    out_features: int
    bias: torch.Tensor | None

    # torch.compile runs the kernel call as it is (it cannot trace a foreign call).
    @torch.compiler.disable
    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        x, out, bf16 = _operands(inputs, self.out_features)
        if x.shape[0]:
            self._multiply(x, out, bf16, _threads())
        return _finish(out, inputs, self.out_features, self.bias)

    @abstractmethod
    def _multiply(self, x: torch.Tensor, out: torch.Tensor, bf16: bool, threads: int) -> None:
        """``out`` = ``x`` times the weight, on this linear's kernel."""


class NativeInt4Linear(_NativeLinear):
    """A group-wise int4 weight ``[N, K]`` in the kernel's layout (no other copy)."""

    __slots__ = ("packed", "scales", "mins", "group", "in_features", "out_features", "bias")

    def __init__(self, spec: LinearSpec, device: torch.device, dtype: torch.dtype) -> None:
        parts = spec.parts or {}
        n, k = spec.out_features, spec.in_features
        codes = quant.unpack_int4(parts["qweight"]).to(torch.uint8).contiguous()
        groups = parts["scales"].shape[1]
        self.group = k // groups
        self.in_features, self.out_features = k, n
        self.packed = torch.empty(_padded(n) * k // 2, dtype=torch.uint8)
        native.library().mesh_pack_int4(codes.data_ptr(), n, k, self.packed.data_ptr())
        # float16, as packages store them (the kernel widens them exactly), each
        # block of 16 outputs' groups together: [N / 16, groups, 16].
        self.scales = _by_output_block(parts["scales"], n)
        self.mins = _by_output_block(parts["mins"], n)
        self.bias = None if spec.bias is None else spec.bias.to(device=device, dtype=dtype)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor, bf16: bool, threads: int) -> None:
        rows, k = x.shape
        work = _Workspace(rows, k, k // self.group, threads)
        native.library().mesh_int4_matmul(
            x.data_ptr(),
            bf16,
            rows,
            k,
            self.out_features,
            self.group,
            self.packed.data_ptr(),
            self.scales.data_ptr(),
            self.mins.data_ptr(),
            out.data_ptr(),
            work.codes,
            work.dscale,
            work.sums,
            work.acc,
            threads,
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales, self.mins, self.bias) if t is not None]


class NativeInt8Linear(_NativeLinear):
    """A per-output-channel int8 weight ``[N, K]`` in the kernel's layout."""

    __slots__ = ("packed", "scales", "in_features", "out_features", "bias")

    def __init__(self, spec: LinearSpec, device: torch.device, dtype: torch.dtype) -> None:
        parts = spec.parts or {}
        n, k = spec.out_features, spec.in_features
        weight = parts["qweight"].to(torch.int8).contiguous()
        self.in_features, self.out_features = k, n
        self.packed = torch.empty(_padded(n) * k, dtype=torch.uint8)
        native.library().mesh_pack_int8(weight.data_ptr(), n, k, self.packed.data_ptr())
        self.scales = torch.zeros(_padded(n))
        self.scales[:n] = parts["scales"].to(torch.float32).reshape(-1)
        self.bias = None if spec.bias is None else spec.bias.to(device=device, dtype=dtype)

    def _multiply(self, x: torch.Tensor, out: torch.Tensor, bf16: bool, threads: int) -> None:
        rows, k = x.shape
        work = _Workspace(rows, k, k // BLOCK, threads)
        native.library().mesh_int8_matmul(
            x.data_ptr(),
            bf16,
            rows,
            k,
            self.out_features,
            self.packed.data_ptr(),
            self.scales.data_ptr(),
            out.data_ptr(),
            work.codes,
            work.dscale,
            work.sums,  # block sums: one int32 per block of 32
            work.acc,
            threads,
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales, self.bias) if t is not None]


def _by_output_block(values: torch.Tensor, n: int) -> torch.Tensor:
    """Per-group values ``[N, groups]`` as float16 ``[N / 16, groups, 16]`` (outputs
    padded to 16 with zeros)."""
    groups = values.shape[1]
    padded = torch.zeros(_padded(n), groups, dtype=torch.float16)
    padded[:n] = values.to(torch.float16)
    return padded.view(-1, 16, groups).transpose(1, 2).contiguous()


def _finish(
    out: torch.Tensor, inputs: torch.Tensor, features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    if out.dtype != inputs.dtype:
        out = out.to(inputs.dtype)
    if inputs.dim() != 2:
        out = out.reshape(*inputs.shape[:-1], features)
    return out if bias is None else out + bias
