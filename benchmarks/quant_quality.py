"""Quantisation quality guard: how far the int8 and int4 packages of SmolLM2-135M move
its next-token distributions away from the dense bfloat16 package.

For every request of workloads.jsonl (rendered with the chat template, cut to
``--max-prompt-tokens``), the dense bfloat16 package first decodes ``--tokens``
greedy tokens. The sequence prompt + generated is then teacher-forced through each
package in one forward pass, and at every generated position compared with the dense
bfloat16 package run the same way:

- greedy agreement: the fraction of positions where both pick the same argmax;
- mean KL(p_bf16 || p_quant) of the next-token distributions (float32 log-softmax).

Every package runs through ``load_stage_runtime`` in bfloat16, except the dense
float32 reference row (float32 against bfloat16: what rounding alone costs). A
package that cannot be built or run is reported, not fatal. Prints a table and
writes JSON (``--out``). Nothing here asserts: the figures are for a person to judge.

``--gguf-types`` adds rows for GGUF files made from the same float weights in other
block types (``Q4_K_M``: llama.cpp's mix; see benchmarks/gguf_variants.py), each
built into the packages ``--gguf-forms`` names; the notes say which layer weights
kept the file's codes and which were rounded again.

    .venv/bin/python benchmarks/quant_quality.py [--tokens 64] [--group-sizes 32 64]
        [--max-prompts 4] [--gguf-types Q4_K_M Q8_0 ...] [--gguf-forms int4 int8]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import common
import gguf_variants
import single_stage
import torch
from single_stage import PackageVariant

from mesh.runtime import qkernels

logger = logging.getLogger("quant_quality")

REFERENCE = PackageVariant("bfloat16")
TABLE_HEADERS = (
    "package",
    "computes in",
    "positions",
    "greedy agreement",
    "mean KL",
    "worst prompt KL",
    "params MB",
    "notes",
)


@dataclass(frozen=True)
class QualityPrompt:
    request_id: str
    workload: str
    ids: tuple[int, ...]


@dataclass
class Candidate:
    """One package compared with the reference, and what it scored per prompt."""

    variant: PackageVariant
    dtype: str
    gguf: str | None = None  # a gguf_variants recipe: the package is built from that file
    kernel: str = "auto"  # quantised CPU kernel (mesh-stage join --quantised-kernel)
    param_bytes: int | None = None
    error: str | None = None
    kept: dict[str, Any] | None = None
    per_prompt: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        kernel = "" if self.kernel == "auto" else f" [{self.kernel} kernel]"
        if self.gguf is not None:
            return f"{self.gguf} file -> {self.variant.name}{kernel}"
        return f"{self.variant.name}{kernel}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--group-sizes", type=int, nargs="+", default=[32], help="int4 group sizes to compare"
    )
    parser.add_argument(
        "--max-prompts",
        type=int,
        default=0,
        help="use this many prompts, taken in turn from each workload (0: all)",
    )
    parser.add_argument(
        "--gguf-types",
        nargs="*",
        default=list(gguf_variants.DEFAULT_RECIPES),
        choices=gguf_variants.RECIPES,
        help="GGUF files to make from the float weights and compare (none: skip)",
    )
    parser.add_argument(
        "--gguf-forms",
        nargs="+",
        default=list(gguf_variants.DEFAULT_FORMS),
        choices=gguf_variants.PACKAGE_FORMS,
        help="packages built from each GGUF file (dense: the file's own dequantisation)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=qkernels.MODES,
        help="score every int4/int8 row with each quantised CPU kernel (native: the "
        "stage's VNNI kernels, torch: torch's weight-only kernels)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    single_stage.add_output_arguments(parser, "quant_quality")
    return parser


def candidates(
    group_sizes: Sequence[int],
    gguf_types: Sequence[str] = (),
    gguf_forms: Sequence[str] = gguf_variants.DEFAULT_FORMS,
    kernels: Sequence[str] = ("auto",),
) -> list[Candidate]:
    """The dense float32 reference row, int8, then int4 at each group size; then each
    GGUF file in each package form; quantised rows once per kernel."""
    from_files = [
        Candidate(gguf_variants.variant(form), "bfloat16", gguf)
        for gguf in gguf_types
        for form in gguf_forms
    ]
    rows = [
        Candidate(PackageVariant("float32"), "float32"),
        Candidate(PackageVariant("bfloat16", "int8"), "bfloat16"),
        *(Candidate(PackageVariant("bfloat16", "int4", g), "bfloat16") for g in group_sizes),
        *(
            Candidate(PackageVariant("bfloat16", "int4", g, "int4"), "bfloat16")
            for g in group_sizes
        ),
        *from_files,
    ]
    return [
        replace(row, kernel=kernel, per_prompt=[])
        for row in rows
        for kernel in (kernels if row.variant.quant else ("auto",))
    ]


def spread_prompts(prompts: Sequence[QualityPrompt], limit: int) -> list[QualityPrompt]:
    """At most ``limit`` prompts (all when 0), one from each workload in turn."""
    if limit <= 0 or limit >= len(prompts):
        return list(prompts)
    queues: dict[str, list[QualityPrompt]] = {}
    for prompt in prompts:
        queues.setdefault(prompt.workload, []).append(prompt)
    chosen: list[QualityPrompt] = []
    while len(chosen) < limit:
        for queue in queues.values():
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


# ---- the maths -----------------------------------------------------------------------


def generated_rows(prompt_tokens: int, generated_tokens: int) -> slice:
    """Rows of a teacher-forced forward over prompt + generated whose logits predict
    the generated tokens (row ``i`` predicts token ``i + 1``)."""
    if prompt_tokens < 1:
        raise ValueError("a prompt has at least one token")
    return slice(prompt_tokens - 1, prompt_tokens - 1 + generated_tokens)


def greedy_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of rows ([positions, vocab]) where both argmaxes agree."""
    _check_shapes(reference, other)
    return (reference.argmax(-1) == other.argmax(-1)).float().mean().item()


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(p_reference || p_other) of each row of logits, in float32."""
    _check_shapes(reference, other)
    ref_log = torch.log_softmax(reference.float(), dim=-1)
    other_log = torch.log_softmax(other.float(), dim=-1)
    return (ref_log.exp() * (ref_log - other_log)).sum(-1)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(p_reference || p_other)."""
    return kl_per_position(reference, other).mean().item()


def _check_shapes(reference: torch.Tensor, other: torch.Tensor) -> None:
    if reference.shape != other.shape or reference.dim() != 2 or reference.shape[0] == 0:
        raise ValueError(
            f"compare logits of equal [positions, vocab] shape, got "
            f"{tuple(reference.shape)} and {tuple(other.shape)}"
        )


def pooled(per_prompt: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Figures over every position of every prompt (each prompt weighs its positions)."""
    positions = sum(p["positions"] for p in per_prompt)
    if positions == 0:
        return {"positions": 0, "agreement": math.nan, "mean_kl": math.nan, "worst_kl": math.nan}
    return {
        "positions": positions,
        "agreement": sum(p["agreement"] * p["positions"] for p in per_prompt) / positions,
        "mean_kl": sum(p["mean_kl"] * p["positions"] for p in per_prompt) / positions,
        "worst_kl": max(p["mean_kl"] for p in per_prompt),
    }


# ---- running packages ----------------------------------------------------------------


def load(package: Path, dtype: str, kernel: str = "auto") -> Any:
    from mesh.runtime import load_config, load_stage_runtime
    from mesh.types import LayerRange

    qkernels.MODE = kernel

    layers = LayerRange(0, load_config(package).num_hidden_layers)
    return load_stage_runtime(package, layers, device="cpu", dtype=dtype)


def teacher_forced(runtime: Any, sequence: Sequence[int], rows: slice) -> torch.Tensor:
    """Float32 logits of ``rows`` from one forward of ``sequence`` at position 0."""
    session = f"quality-{time.monotonic_ns()}"
    try:
        logits = runtime.forward(session, 0, torch.tensor(list(sequence), dtype=torch.long))
    finally:
        runtime.drop_session(session)
    return logits[rows].float().clone()


def build_prompts(tokenizer: Any, workloads: dict, limit: int) -> list[QualityPrompt]:
    out = []
    for workload, requests in workloads.items():
        for request in requests:
            head, tail = single_stage.chat_prompt_parts(tokenizer, request.messages)
            ids = single_stage.fit_prompt(head, tail, limit)
            out.append(QualityPrompt(request.request_id, workload, tuple(ids)))
    return out


def reference_pass(
    package: Path, prompts: Sequence[QualityPrompt], tokens: int, stop: Sequence[int]
) -> list[tuple[list[int], slice, torch.Tensor]]:
    """Per prompt: the sequence prompt + greedy tokens of the reference package, the
    rows to compare, and the reference's teacher-forced logits of those rows."""
    runtime = load(package, REFERENCE.dtype)
    out = []
    for prompt in prompts:
        generated = single_stage.runtime_greedy(runtime, prompt.ids, tokens, stop=stop).tokens
        sequence = [*prompt.ids, *generated]
        rows = generated_rows(len(prompt.ids), len(generated))
        out.append((sequence, rows, teacher_forced(runtime, sequence, rows)))
    return out


def score(
    candidate: Candidate,
    package: Path,
    prompts: Sequence[QualityPrompt],
    references: Sequence[tuple[list[int], slice, torch.Tensor]],
) -> None:
    runtime = load(package, candidate.dtype, candidate.kernel)
    candidate.param_bytes = runtime.param_bytes
    for prompt, (sequence, rows, reference) in zip(prompts, references, strict=True):
        logits = teacher_forced(runtime, sequence, rows)
        candidate.per_prompt.append(
            {
                "request_id": prompt.request_id,
                "workload": prompt.workload,
                "prompt_tokens": len(prompt.ids),
                "positions": reference.shape[0],
                "agreement": greedy_agreement(reference, logits),
                "mean_kl": mean_kl(reference, logits),
            }
        )


def prepare(workdir: Path, candidate: Candidate) -> Path | None:
    """The candidate's package, or None with ``candidate.error`` set."""
    try:
        if candidate.gguf is not None:
            quant = candidate.variant.quant or "dense"
            package = gguf_variants.ensure_package(workdir, candidate.gguf, quant)
            candidate.kept = gguf_variants.kept(package)
        else:
            package = single_stage.ensure_package(workdir, candidate.variant)
    except Exception as error:  # noqa: BLE001 - report the variant, go on
        candidate.error = f"build failed: {type(error).__name__}: {error}"
        return None
    candidate.error = single_stage.probe_package(package, candidate.dtype)
    return None if candidate.error else package


def table_rows(rows: Sequence[Candidate]) -> list[list[str]]:
    out = []
    for row in rows:
        figures = pooled(row.per_prompt)
        params = "-" if row.param_bytes is None else f"{row.param_bytes / 1e6:.1f}"
        out.append(
            [
                row.label,
                row.dtype,
                str(figures["positions"]),
                common.fmt(100 * figures["agreement"], 1) + ("%" if figures["positions"] else ""),
                common.fmt(figures["mean_kl"], 4),
                common.fmt(figures["worst_kl"], 4),
                params,
                row.error or (gguf_variants.kept_note(row.kept) if row.kept else "-"),
            ]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.tokens < 1 or args.max_prompt_tokens < 8:
        raise SystemExit("--tokens must be at least 1 and --max-prompt-tokens at least 8")
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    load_start = common.load_average()
    workloads = common.load_workloads(args.workloads or common.default_workloads_path())
    rows = candidates(args.group_sizes, args.gguf_types, args.gguf_forms, args.kernels)
    files: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as scratch:
        workdir = (args.workdir or Path(scratch)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        reference = single_stage.ensure_package(workdir, REFERENCE)
        prompts = spread_prompts(
            build_prompts(
                AutoTokenizer.from_pretrained(reference), workloads, args.max_prompt_tokens
            ),
            args.max_prompts,
        )
        for recipe in args.gguf_types:
            try:
                files[recipe] = gguf_variants.ensure_gguf(workdir, recipe)
            except Exception as error:  # noqa: BLE001 - its rows report it
                logger.warning("cannot make the %s file: %s", recipe, error, exc_info=True)
                files[recipe] = {"error": f"{type(error).__name__}: {error}"}
        stop = single_stage.package_eos_ids(reference)
        references = reference_pass(reference, prompts, args.tokens, stop)
        for row in rows:
            package = prepare(workdir, row)
            if package is None:
                continue
            try:
                score(row, package, prompts, references)
            except Exception as error:  # noqa: BLE001 - one failing row must not end the run
                logger.warning("%s failed: %s", row.label, error, exc_info=True)
                row.error = f"{type(error).__name__}: {error}"
    common.emit(
        f"{len(prompts)} prompts (at most {args.max_prompt_tokens} tokens), up to "
        f"{args.tokens} greedy tokens each from {REFERENCE.name}; every row against "
        f"{REFERENCE.name} teacher-forced\n\n"
        + common.render_table(TABLE_HEADERS, table_rows(rows))
    )
    if files:
        common.emit("\n" + gguf_variants.files_table(files))
    payload = {
        "benchmark": "quant_quality",
        "command": common.command_line(),
        "machine": common.machine_info(args.threads),
        "load_average_start": load_start,
        "load_average_end": common.load_average(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "reference": REFERENCE.name,
        "gguf_files": files,
        "prompts": [
            {"request_id": p.request_id, "workload": p.workload, "tokens": len(p.ids)}
            for p in prompts
        ],
        "rows": [
            {
                "package": row.label,
                "gguf": row.gguf,
                "kept": row.kept,
                "computes_in": row.dtype,
                "param_bytes": row.param_bytes,
                "error": row.error,
                "pooled": pooled(row.per_prompt),
                "per_prompt": row.per_prompt,
            }
            for row in rows
        ],
    }
    common.write_json(args.out, payload)
    common.emit(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
