"""How the cost of a linear layer grows with the number of rows, for every weight
format the runtime has, and for the quantised matmul paths torch offers on CPU.

Stages run many sessions' tokens in one forward pass (batched decode, verify windows,
prefill chunks), so what matters is the time of an ``R``-row call against a one-row
call. For each shape and each row count, every candidate runs in rotated order within
a repeat; the figure is the median over repeats of the per-call time. Candidates:

- dense: ``PackedLinear`` (oneDNN) in float32 and bfloat16, ``F.linear`` in bfloat16;
- int4: torch's CPU kernel; the weight dequantised per call to bfloat16 then a
  bfloat16 GEMM; dequantised per call to float32 then a float32 GEMM (whole, and in
  cache-sized tiles of outputs, as ``Int4Linear.gemm``); ``Int4Linear`` as the
  runtime calls it (kernel below ``GEMM_ROWS`` rows, tiles from there);
- int8: torch's kernel; dequantise to bfloat16 + GEMM; to float32 + GEMM (whole,
  and tiled as ``Int8Linear.gemm``); ``Int8Linear``; and two that quantise the
  activations too (they change numerics): per-row int8 activations with
  ``torch._int_mm``, and fbgemm's ``quantized::linear_dynamic`` (one activation
  scale per call);
- int4 and int8 on the stage's own kernels (``NativeInt4Linear``,
  ``NativeInt8Linear``, mesh/runtime/qkernels.py; activations in two int8 parts per
  block of 32, VNNI dot products, AMX tiles from ``native.AMX_ROWS_INT4`` and
  ``AMX_ROWS_INT8`` rows), and the same with AMX off and with AMX at every row
  count, where this machine can build and run them.

For every candidate the script also reports the largest error against the float32
product of the same (bfloat16-rounded) activations and dequantised weight, relative
to the largest output, and whether the first rows of every ``R``-row call are bitwise
equal to the same rows computed alone ("batch invariant"). A probe lists the
quantised matmul ops this torch has. Prints tables and writes JSON; nothing is asserted.

    .venv/bin/python benchmarks/quant_rows_bench.py [--threads 1] [--repeats 9]
        [--rows 1 2 4 8 16 32 64 128 512] [--json bench-results/quant_rows.json]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import common
import torch
import torch.nn.functional as F

from mesh import quant
from mesh.runtime import native, qkernels
from mesh.runtime.linear import (
    Int4Linear,
    Int8Linear,
    LinearSpec,
    PackedLinear,
    build_linear,
)
from mesh.runtime.qkernels import NativeInt4Linear, NativeInt8Linear

logger = logging.getLogger("quant_rows_bench")

CPU = torch.device("cpu")
# SmolLM2-135M (hidden 576, intermediate 1536; fused q/k/v and gate/up) and one
# bigger layer, as [N, K] = [out_features, in_features].
SHAPES = {
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "up 2048->8192": (8192, 2048),
}
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
INT4_GROUP = quant.DEFAULT_INT4_GROUP
# Time a candidate over at least this long per sample (several calls when one is short).
SAMPLE_S = 0.002
# Rows whose error against the float32 reference is reported.
ERROR_ROWS = 16
# Rows of each call compared bitwise with the same row computed alone.
INVARIANCE_ROWS = 16


Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    format: str  # dense-f32 | dense-bf16 | int4 | int8
    name: str
    call: Kernel
    activation_dtype: torch.dtype
    changes_numerics: bool = False


def probe_ops() -> dict[str, list[str]]:
    """The quantised matmul ops this torch build registers (aten, quantized, onednn)."""
    words = ("int4", "int8", "quant", "_int_mm")
    found = {"aten": sorted(op for op in dir(torch.ops.aten) if any(w in op for w in words))}
    for namespace in ("quantized", "onednn", "mkldnn"):
        ops = getattr(torch.ops, namespace)
        names = [
            "linear_dynamic",
            "linear_prepack",
            "int4mm_packed_weight_cpu",
            "qlinear_pointwise",
            "qlinear_prepack",
            "_linear_pointwise",
            "_reorder_linear_weight",
        ]
        present = []
        for name in names:
            try:
                getattr(ops, name)
            except (AttributeError, RuntimeError):
                continue
            present.append(name)
        found[namespace] = present
    return found


def dense_candidates(weight: torch.Tensor) -> list[Candidate]:
    f32 = PackedLinear(weight.contiguous(), None)
    bf16_weight = weight.to(torch.bfloat16).contiguous()
    bf16 = PackedLinear(bf16_weight, None)
    return [
        Candidate("dense-f32", "PackedLinear", f32, torch.float32),
        Candidate("dense-bf16", "PackedLinear", bf16, torch.bfloat16),
        Candidate("dense-bf16", "F.linear", lambda x: F.linear(x, bf16_weight), torch.bfloat16),
    ]


def with_kernels(mode: str, spec: LinearSpec) -> object | None:
    """``build_linear(spec)`` with ``--quantised-kernel mode``; None where that mode
    does not give a kernel of its own here."""
    saved = qkernels.MODE
    qkernels.MODE = mode
    try:
        built = build_linear(spec, CPU, torch.bfloat16)
    finally:
        qkernels.MODE = saved
    native = isinstance(built, (NativeInt4Linear, NativeInt8Linear))
    return built if native == (mode == "native") else None


def native_candidate(fmt: str, spec: LinearSpec) -> list[Candidate]:
    try:
        linear = with_kernels("native", spec)
    except (RuntimeError, ValueError) as error:  # not buildable here: say so, go on
        logger.warning("no native %s kernel: %s", fmt, error)
        return []
    if linear is None:
        return []
    found = [Candidate(fmt, "native (2x int8 act.)", linear, torch.bfloat16, True)]
    if native.amx():
        for label, rows in (("native, VNNI only", 0), ("native, AMX only", 1)):
            found.append(Candidate(fmt, label, _amx_from(linear, rows), torch.bfloat16, True))
    return found


def _amx_from(linear: Kernel, rows: int) -> Kernel:
    """``linear`` with AMX from ``rows`` rows for int4 and int8 weights (0: never),
    the default rule restored after each call."""

    def call(x: torch.Tensor) -> torch.Tensor:
        native.set_amx_rows(rows, rows)
        try:
            return linear(x)
        finally:
            native.set_amx_rows()

    return call


def int4_candidates(parts: dict[str, torch.Tensor], n: int, k: int) -> list[Candidate]:
    spec = LinearSpec(n, k, "int4", parts=parts)
    linear = with_kernels("torch", spec)
    assert isinstance(linear, Int4Linear)
    group = linear.group

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return linear._mm(x, linear.packed, group, linear.scales_zeros)

    def deq_bf16(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, linear.dequantized_t().to(torch.bfloat16))

    def deq_f32(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.to(torch.float32), linear.dequantized_t()).to(torch.bfloat16)

    found = [Candidate("int4", "kernel", kernel, torch.bfloat16)]
    if linear._block:
        found += [
            Candidate("int4", "deq-bf16+gemm", deq_bf16, torch.bfloat16),
            Candidate("int4", "deq-f32+gemm whole", deq_f32, torch.bfloat16),
            Candidate("int4", "deq-f32+gemm tiles", linear.gemm, torch.bfloat16),
        ]
    found.append(Candidate("int4", "Int4Linear (rule)", linear, torch.bfloat16))
    return found + native_candidate("int4", spec)


def int8_candidates(parts: dict[str, torch.Tensor], n: int, k: int) -> list[Candidate]:
    spec = LinearSpec(n, k, "int8", parts=parts)
    linear = with_kernels("torch", spec)
    assert isinstance(linear, Int8Linear)
    qweight, scales = linear.qweight, linear.scales
    scales32 = parts["scales"].to(torch.float32)
    qweight_t = qweight.t().contiguous()
    prepacked = fbgemm_prepack(parts)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)

    def deq_bf16(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, qweight.to(torch.bfloat16)) * scales

    def deq_f32(x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.float32), qweight.to(torch.float32)) * scales
        return out.to(torch.bfloat16)

    def w8a8_rows(x: torch.Tensor) -> torch.Tensor:
        # Symmetric int8 activations with one scale per row: integer accumulation.
        x32 = x.to(torch.float32)
        row_scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        codes = torch.round(x32 / row_scale).to(torch.int8)
        return (torch._int_mm(codes, qweight_t) * (row_scale * scales32)).to(torch.bfloat16)

    found = [
        Candidate("int8", "kernel", kernel, torch.bfloat16),
        Candidate("int8", "deq-bf16+gemm", deq_bf16, torch.bfloat16),
        Candidate("int8", "deq-f32+gemm whole", deq_f32, torch.bfloat16),
        Candidate("int8", "deq-f32+gemm tiles", lambda x: linear.gemm(x, scales), torch.bfloat16),
        Candidate("int8", "Int8Linear (rule)", linear, torch.bfloat16),
        Candidate("int8", "w8a8 per-row _int_mm", w8a8_rows, torch.bfloat16, True),
    ]
    if prepacked is not None:

        def fbgemm(x: torch.Tensor) -> torch.Tensor:
            out = torch.ops.quantized.linear_dynamic(x.to(torch.float32), prepacked)
            return out.to(torch.bfloat16)

        found.append(Candidate("int8", "fbgemm linear_dynamic", fbgemm, torch.bfloat16, True))
    return found + native_candidate("int8", spec)


def fbgemm_prepack(parts: dict[str, torch.Tensor]) -> object | None:
    """fbgemm's packed form of the int8 weight (per-channel scales), or None."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    torch.backends.quantized.engine = "fbgemm"
    scales = parts["scales"].to(torch.float64)
    zero_points = torch.zeros(scales.shape[0], dtype=torch.long)
    qweight = torch._make_per_channel_quantized_tensor(parts["qweight"], scales, zero_points, 0)
    return torch.ops.quantized.linear_prepack(qweight, None)


def time_call(call: Kernel, x: torch.Tensor) -> float:
    """Seconds per call, over as many calls as fill ``SAMPLE_S``."""
    start = time.perf_counter()
    call(x)
    once = time.perf_counter() - start
    calls = max(1, min(50, int(SAMPLE_S / max(once, 1e-7))))
    start = time.perf_counter()
    for _ in range(calls):
        call(x)
    return (time.perf_counter() - start) / calls


def reference(candidate: Candidate, weight32: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The float32 product of the activations as the candidate takes them."""
    return F.linear(x.to(candidate.activation_dtype).to(torch.float32), weight32)


def invariance(candidate: Candidate, inputs: dict[int, torch.Tensor]) -> int | None:
    """The first row count at which one of the first ``INVARIANCE_ROWS`` rows differs
    bitwise from the same row computed alone, or None."""
    batch = inputs[max(inputs)].to(candidate.activation_dtype)
    alone = [candidate.call(batch[i : i + 1]) for i in range(min(INVARIANCE_ROWS, len(batch)))]
    for rows, x in inputs.items():
        out = candidate.call(x.to(candidate.activation_dtype))
        if not all(torch.equal(out[i : i + 1], alone[i]) for i in range(min(rows, len(alone)))):
            return rows
    return None


def measure_shape(
    label: str, n: int, k: int, rows_list: list[int], repeats: int
) -> list[dict[str, object]]:
    generator = torch.Generator().manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=generator) * 0.05
    int4_parts = quant.quantize_int4(weight, INT4_GROUP)
    int8_parts = quant.quantize_int8(weight)
    weights32 = {
        "dense-f32": weight,
        "dense-bf16": weight.to(torch.bfloat16).to(torch.float32),
        "int8": quant.dequantize_int8(int8_parts, torch.float32),
    }
    weights32["int4"] = int4_reference_weight(int4_parts)
    candidates = (
        dense_candidates(weight)
        + int4_candidates(int4_parts, n, k)
        + int8_candidates(int8_parts, n, k)
    )
    # Every row count takes the first rows of one batch (channels of uneven size, as
    # in real activations), so row 0 is the same row in every call.
    column_scale = 1.0 + torch.rand(1, k, generator=generator) * 3
    batch = torch.randn(max(rows_list), k, generator=generator) * column_scale
    inputs = {rows: batch[:rows].contiguous() for rows in rows_list}
    samples: dict[tuple[str, str, int], list[float]] = {}
    for repeat in range(-1, repeats):  # repeat -1 warms up and is not kept
        for rows in rows_list:
            cast = {dtype: inputs[rows].to(dtype) for dtype in (torch.float32, torch.bfloat16)}
            for candidate in common.rotated(candidates, repeat + rows):
                seconds = time_call(candidate.call, cast[candidate.activation_dtype])
                if repeat >= 0:
                    key = (candidate.format, candidate.name, rows)
                    samples.setdefault(key, []).append(seconds)
    results = []
    error_rows = ERROR_ROWS if ERROR_ROWS in inputs else rows_list[-1]
    for candidate in candidates:
        x = inputs[error_rows]
        expected = reference(candidate, weights32[candidate.format], x)
        got = candidate.call(x.to(candidate.activation_dtype)).to(torch.float32)
        relative_error = float((got - expected).abs().max() / expected.abs().max())
        one_row = common.median(samples[(candidate.format, candidate.name, 1)])
        by_rows = {}
        for rows in rows_list:
            median = common.median(samples[(candidate.format, candidate.name, rows)])
            by_rows[rows] = {
                "us": median * 1e6,
                "ratio_to_one_row": common.ratio(median, one_row),
                "spread_us": {
                    key: value * 1e6 if key != "n" else value
                    for key, value in common.spread(
                        samples[(candidate.format, candidate.name, rows)]
                    ).items()
                },
            }
        results.append(
            {
                "shape": label,
                "out_features": n,
                "in_features": k,
                "format": candidate.format,
                "candidate": candidate.name,
                "changes_numerics": candidate.changes_numerics,
                "max_error_vs_float32": relative_error,
                "first_rows_not_batch_invariant": invariance(candidate, inputs),
                "rows": by_rows,
            }
        )
    return results


def int4_reference_weight(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The int4 weight as ``Int4Linear`` gives it to the kernel: scales and zeros
    (zero = min + 8 scale) rounded to bfloat16, ``(code - 8) * scale + zero``."""
    codes = quant.unpack_int4(parts["qweight"]).to(torch.float32)
    rows, cols = codes.shape
    scales = parts["scales"].to(torch.float32)
    zeros = parts["mins"].to(torch.float32) + 8 * scales

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).to(torch.float32)

    scales, zeros = rounded(scales), rounded(zeros)
    grouped = codes.reshape(rows, scales.shape[1], -1) - 8
    weight = grouped * scales.unsqueeze(-1) + zeros.unsqueeze(-1)
    return weight.reshape(rows, cols)


def render(results: list[dict[str, object]], rows_list: list[int], ratios: bool) -> str:
    """Per candidate: microseconds per call by rows (``ratios``: the 1-row time, then
    each R-row time over it), its error and batch invariance."""
    headers = ["shape", "format", "candidate"]
    if ratios:
        headers += ["1 row us"] + [f"x{rows}" for rows in rows_list[1:]]
    else:
        headers += [f"{rows} us" for rows in rows_list]
    headers += ["max err", "batch-inv"]
    table = []
    for result in results:
        by_rows = result["rows"]
        first_bad = result["first_rows_not_batch_invariant"]
        line = [
            str(result["shape"]),
            str(result["format"]),
            str(result["candidate"]) + (" *" if result["changes_numerics"] else ""),
        ]
        if ratios:
            line.append(common.fmt(by_rows[rows_list[0]]["us"], 0))
            line += [common.fmt(by_rows[rows]["ratio_to_one_row"], 1) for rows in rows_list[1:]]
        else:
            line += [common.fmt(by_rows[rows]["us"], 0) for rows in rows_list]
        line += [
            f"{result['max_error_vs_float32']:.1e}",
            "yes" if first_bad is None else f"no ({first_bad})",
        ]
        table.append(line)
    return common.render_table(headers, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=9, help="measured repeats (>= 1)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="[N, K] layers"
    )
    parser.add_argument("--json", type=Path, default=Path("bench-results") / "quant_rows.json")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("--repeats and --threads must be at least 1")
    rows_list = sorted(set(args.rows) | {1})
    torch.set_num_threads(args.threads)
    ops = probe_ops()
    common.emit("quantised matmul ops in torch " + torch.__version__)
    for namespace, names in ops.items():
        common.emit(f"  {namespace}: {', '.join(names) or '-'}")
    results: list[dict[str, object]] = []
    for label in args.shapes:
        n, k = SHAPES[label]
        logger.warning("measuring %s", label)
        results += measure_shape(label, n, k, rows_list, args.repeats)
    common.emit(
        f"\nTime of an R-row call (us), then the 1-row time and each R-row time over it "
        f"(xR); median of "
        f"{args.repeats} repeats, {args.threads} thread(s); max err: largest error "
        f"against the float32 product at {ERROR_ROWS} rows over the largest output; "
        f"batch-inv: the first {INVARIANCE_ROWS} rows of every R-row call bitwise equal "
        "to each row computed alone (else the first R that differs); * quantises "
        "activations (changes numerics)\n"
    )
    common.emit(render(results, rows_list, ratios=False))
    common.emit("")
    common.emit(render(results, rows_list, ratios=True))
    common.write_json(
        args.json,
        {
            "machine": common.machine_info(args.threads),
            "command": common.command_line(),
            "int4_group": INT4_GROUP,
            "repeats": args.repeats,
            "ops": ops,
            "results": results,
        },
    )
    common.emit(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
