"""Engine benchmark: every way this machine runs SmolLM2-135M, on the same prompts.

Rows, all in one process and on the same prompt token ids:

- HF ``generate`` in float32 and bfloat16 (transformers loading the GGUF);
- the mesh single-stage engine (one ``StageRuntime`` holding every layer) on four
  packages: dense float32 computing in float32, and dense bfloat16, int8 and int4
  computing in bfloat16, each eager and, unless ``--no-compile``, through
  torch.compile;
- llama.cpp (llama-cpp-python, low-level ``eval``) on the same GGUF, when installed.

Each row runs a chat prompt and a ~400-token code prompt (``--code-tokens``) and
decodes ``--tokens`` greedy tokens with end-of-sequence held back. Prefill rate is
prompt tokens over the time to the first token; decode rate is the tokens after the
first over the time from the first token to the last. Repeats are interleaved (the
repeat loop is outside, rows inside, in rotated order) and figures are medians. A
row that cannot be built, loaded or run is reported, not fatal: each mesh package is
first run in a short child process, so a crash in a native kernel marks its rows
failed instead of ending the benchmark. Goals are printed as met or not, never
asserted. Prints a table, writes JSON (``--out``).

    .venv/bin/python benchmarks/engine_bench.py [--repeats 3] [--tokens 128] [--no-compile]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import common
import single_stage
from single_stage import Generation, PackageVariant

logger = logging.getLogger("engine_bench")

PROMPTS = ("chat", "code")
HF_DTYPES = ("float32", "bfloat16")
LLAMA_KEY = "llama.cpp"
GOAL_DECODE_VS_HF = 1.5
GOAL_INT4_VS_LLAMA = 0.7
GOAL_INT4_PARAMS_VS_GGUF = 1.3


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: tuple[int, ...]
    source: str


@dataclass
class Engine:
    """One row: how it runs a prompt, what it holds, and what went wrong."""

    key: str
    engine: str
    variant: str
    family: str | None  # the HF dtype it is compared with; None: llama.cpp
    compile: bool | None = None
    run: Callable[[Sequence[int], int], Generation] | None = None
    param_bytes: int | None = None
    param_note: str = ""
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    still_compiled: Callable[[], bool] | None = None


# ---- arguments and prompts ---------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="measured repeats (median)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch and llama.cpp threads"
    )
    parser.add_argument(
        "--compile-variants",
        dest="compile_variants",
        action="store_true",
        default=True,
        help="also run every mesh row through torch.compile (the default)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile_variants",
        action="store_false",
        help="skip the torch.compile rows (compiling takes a while)",
    )
    parser.add_argument(
        "--row-invariant",
        default="auto",
        help="mesh-stage --row-invariant of the mesh rows; several, comma-separated (e.g. "
        "off,on), give one row each and a price table (invariant over previous arithmetic)",
    )
    parser.add_argument("--code-tokens", type=int, default=400, help="code prompt length")
    parser.add_argument("--int4-group-size", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens per warm-up run")
    parser.add_argument("--check-tokens", type=int, default=32, help="tokens compared with HF")
    single_stage.add_output_arguments(parser, "engine")
    return parser


def package_variants(int4_group_size: int) -> list[tuple[PackageVariant, str]]:
    """The packages of the mesh rows, each with the dtype it computes in."""
    return [
        (PackageVariant("float32"), "float32"),
        (PackageVariant("bfloat16"), "bfloat16"),
        (PackageVariant("bfloat16", "int8"), "bfloat16"),
        (PackageVariant("bfloat16", "int4", int4_group_size), "bfloat16"),
        (PackageVariant("bfloat16", "int4", int4_group_size, "int4"), "bfloat16"),
    ]


def choose_closest(lengths: Sequence[int], target: int) -> int:
    """Index of the shortest length reaching ``target``, else of the longest."""
    if not lengths:
        raise ValueError("no candidates")
    reaching = [i for i, n in enumerate(lengths) if n >= target]
    if reaching:
        return min(reaching, key=lambda i: lengths[i])
    return max(range(len(lengths)), key=lambda i: lengths[i])


def build_prompts(tokenizer: Any, workloads: dict, code_tokens: int) -> list[Prompt]:
    """The first chat request, and a code prompt of ``code_tokens`` ids: code-edit
    requests joined in one message until long enough, then cut to length."""
    chat = workloads["chat"][0]
    head, tail = single_stage.chat_prompt_parts(tokenizer, chat.messages)
    edits = workloads["code-edit"]
    candidates = []
    for count in range(1, len(edits) + 1):
        joined = "\n\n".join(r.messages[-1]["content"] for r in edits[:count])
        messages = [*edits[0].messages[:-1], {"role": "user", "content": joined}]
        candidates.append(single_stage.chat_prompt_parts(tokenizer, messages))
    pick = choose_closest([len(h) + len(t) for h, t in candidates], code_tokens)
    return [
        Prompt("chat", tuple(head + tail), chat.request_id),
        Prompt(
            "code",
            tuple(single_stage.fit_prompt(*candidates[pick], code_tokens)),
            "+".join(r.request_id for r in edits[: pick + 1]),
        ),
    ]


# ---- engines -----------------------------------------------------------------------


class TokenClock:
    """A ``generate`` streamer noting when each new token arrives (the first put()
    carries the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.stamps.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        return None


def unique_param_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of ``tensors``, a tensor shared under several names counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def hf_engine(gguf: Path, dtype: str, banned: Sequence[int]) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    ).eval()

    def run(prompt_ids: Sequence[int], tokens: int) -> Generation:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        clock = TokenClock()
        started = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                eos_token_id=list(banned) or None,
                pad_token_id=banned[0] if banned else None,
                streamer=clock,
            )
        return Generation(output[0, ids.shape[1] :].tolist(), started, clock.stamps)

    engine = Engine(f"hf-{dtype}", "HF generate", dtype, dtype, run=run)
    engine.param_bytes = unique_param_bytes(model.parameters())
    return engine


def mesh_row(variant: PackageVariant, dtype: str, compile: bool, mode: str = "auto") -> Engine:
    label = variant.name if variant.quant else variant.dtype
    label = label if dtype == variant.dtype and not variant.quant else f"{label} @ {dtype}"
    suffix = "" if mode == "auto" else f"-ri-{mode}"
    return Engine(
        key=f"mesh-{variant.name}-{'compile' if compile else 'eager'}{suffix}",
        engine="mesh",
        variant=label if mode == "auto" else f"{label}, row-invariant {mode}",
        family=dtype,
        compile=compile,
    )


def mesh_engine(
    package: Path,
    variant: PackageVariant,
    dtype: str,
    compile: bool,
    banned: Sequence[int],
    mode: str = "auto",
) -> Engine:
    from mesh.runtime import invariant, load_config, load_stage_runtime
    from mesh.types import LayerRange

    layers = LayerRange(0, load_config(package).num_hidden_layers)
    # The runtime decides its arithmetic when it loads.
    before, invariant.MODE = invariant.MODE, mode
    try:
        runtime = load_stage_runtime(package, layers, device="cpu", dtype=dtype, compile=compile)
    finally:
        invariant.MODE = before
    engine = mesh_row(variant, dtype, compile, mode)
    engine.run = lambda ids, tokens: single_stage.runtime_greedy(
        runtime, ids, tokens, banned=banned
    )
    engine.param_bytes = runtime.param_bytes
    if compile:
        engine.still_compiled = lambda: runtime.compiled
    return engine


def llama_engine(gguf: Path, threads: int, banned: Sequence[int]) -> Engine:
    engine = llama_row(gguf)
    try:
        import llama_cpp
    except ImportError:
        engine.error = "not installed"
        return engine
    import numpy as np
    import torch

    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
        logits_all=False,
    )
    vocab = llm.n_vocab()

    def run(prompt_ids: Sequence[int], tokens: int) -> Generation:
        emitted: list[int] = []
        stamps: list[float] = []
        llm.reset()
        started = time.perf_counter()
        llm.eval(list(prompt_ids))
        while True:
            # logits_all=False keeps llm.scores empty: read the last row from the context
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (vocab,))
            emitted.append(single_stage.greedy_token(torch.from_numpy(logits), banned))
            stamps.append(time.perf_counter())
            if len(emitted) >= tokens:
                return Generation(emitted, started, stamps)
            llm.eval([emitted[-1]])

    engine.run = run
    return engine


def llama_row(gguf: Path) -> Engine:
    engine = Engine(LLAMA_KEY, "llama.cpp", gguf_label(gguf), None, param_note=" (GGUF file)")
    engine.param_bytes = gguf.stat().st_size
    return engine


def gguf_label(gguf: Path) -> str:
    try:
        import gguf as gguf_lib

        file_type = gguf_lib.GGUFReader(str(gguf)).fields["general.file_type"].parts[-1][0]
        return "GGUF " + gguf_lib.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except Exception:  # noqa: BLE001 - the label is informative only
        return "GGUF"


def guarded(make: Callable[[], Engine], fallback: Engine) -> Engine:
    """``make()``, or ``fallback`` carrying the error when it fails."""
    try:
        return make()
    except Exception as error:  # noqa: BLE001 - one failing row must not end the run
        logger.warning("%s: %s", fallback.key, error, exc_info=logger.isEnabledFor(logging.INFO))
        fallback.error = f"{type(error).__name__}: {error}"
        return fallback


# ---- figures -----------------------------------------------------------------------


def generation_figures(generation: Generation, prompt_tokens: int) -> dict[str, Any]:
    stamps = generation.stamps
    first_s = stamps[0] - generation.started
    return {
        "first_token_s": first_s,
        "prefill_tok_s": common.ratio(prompt_tokens, first_s),
        "decode_tok_s": common.ratio(len(stamps) - 1, stamps[-1] - stamps[0]),
        "tokens": list(generation.tokens),
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per prompt: median prefill and decode rates, and the first run's tokens."""
    return {
        prompt: {
            "prefill_tok_s": common.median([f["prefill_tok_s"] for f in figures]),
            "decode_tok_s": common.median([f["decode_tok_s"] for f in figures]),
            "runs": len(figures),
            "tokens": figures[0]["tokens"] if figures else [],
        }
        for prompt, figures in runs.items()
    }


def first_difference(tokens: Sequence[int], reference: Sequence[int], count: int) -> int | None:
    """Where the first ``count`` tokens first differ from the reference's, or None."""
    mine, theirs = list(tokens[:count]), list(reference[:count])
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return index
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def compare(engine: Engine, summary: dict[str, dict], check_tokens: int) -> dict[str, Any]:
    """Per prompt: decode rate over HF's in the same dtype and over llama.cpp's, and
    where the tokens first differ from HF's (llama.cpp: from HF float32); "n/a" when
    either side has no tokens."""
    empty = {p: {"decode_tok_s": math.nan, "tokens": []} for p in PROMPTS}
    mine = summary.get(engine.key, empty)
    hf = summary.get(f"hf-{engine.family}", empty)
    llama = summary.get(LLAMA_KEY, empty)
    reference = summary.get(f"hf-{engine.family or 'float32'}", empty)
    row: dict[str, Any] = {"vs_hf": {}, "vs_llama": {}, "first_token_difference": {}}
    for p in PROMPTS:
        row["vs_hf"][p] = common.ratio(mine[p]["decode_tok_s"], hf[p]["decode_tok_s"])
        row["vs_llama"][p] = common.ratio(mine[p]["decode_tok_s"], llama[p]["decode_tok_s"])
        ours, theirs = mine[p]["tokens"], reference[p]["tokens"]
        row["first_token_difference"][p] = (
            first_difference(ours, theirs, check_tokens) if ours and theirs else "n/a"
        )
    return row


def goals(engines: Sequence[Engine], rows: dict[str, dict], gguf_bytes: int) -> list[dict]:
    """Each goal with the figure it is judged on (the worse prompt) and whether met
    (None: not measured)."""
    out = []
    for engine in (e for e in engines if e.engine == "mesh"):
        row = rows.get(engine.key, {})
        text = f"{engine.key} decode >= {GOAL_DECODE_VS_HF}x HF {engine.family}"
        out.append(_goal(text, _worst(row.get("vs_hf", {})), GOAL_DECODE_VS_HF, at_least=True))
        if engine.key.startswith("mesh-int4"):
            text = f"{engine.key} decode >= {GOAL_INT4_VS_LLAMA}x llama.cpp"
            worst = _worst(row.get("vs_llama", {}))
            out.append(_goal(text, worst, GOAL_INT4_VS_LLAMA, at_least=True))
    for engine in engines:
        if engine.key.startswith("mesh-int4") and not engine.compile:
            text = f"{engine.key} parameter bytes <= {GOAL_INT4_PARAMS_VS_GGUF}x GGUF file"
            value = common.ratio(engine.param_bytes, gguf_bytes) if engine.param_bytes else math.nan
            out.append(_goal(text, value, GOAL_INT4_PARAMS_VS_GGUF))
    return out


def int4_over_gguf(engines: Sequence[Engine], gguf_bytes: int) -> float:
    sizes = [e.param_bytes for e in engines if e.key.startswith("mesh-int4") and e.param_bytes]
    return common.ratio(sizes[0], gguf_bytes) if sizes else math.nan


def _worst(values: dict[str, float]) -> float:
    finite = [v for v in values.values() if not math.isnan(v)]
    return min(finite) if len(finite) == len(PROMPTS) else math.nan


def _goal(text: str, value: float, bound: float, *, at_least: bool = False) -> dict[str, Any]:
    met = None if math.isnan(value) else (value >= bound if at_least else value <= bound)
    return {"goal": text, "value": value, "met": met}


TABLE_HEADERS = (
    "engine",
    "dtype/quant",
    "compile",
    "prefill tok/s chat / code",
    "decode tok/s chat / code",
    "params MB",
    "decode vs HF",
    "decode vs llama.cpp",
    "same tokens as HF",
    "notes",
)


def pair(values: dict[str, float], digits: int = 1, suffix: str = "") -> str:
    cells = [common.fmt(values.get(p, math.nan), digits) for p in PROMPTS]
    return " / ".join(c if c == "-" else c + suffix for c in cells)


def same_tokens_cell(differences: dict[str, Any]) -> str:
    cells = [differences.get(p, "n/a") for p in PROMPTS]
    return " / ".join("-" if d == "n/a" else "yes" if d is None else f"no@{d}" for d in cells)


def table_rows(
    engines: Sequence[Engine], summary: dict[str, dict], rows: dict[str, dict]
) -> list[list[str]]:
    out = []
    for engine in engines:
        compile_cell = "-" if engine.compile is None else "on" if engine.compile else "off"
        params = "-" if engine.param_bytes is None else f"{engine.param_bytes / 1e6:.1f}"
        if engine.error:
            cells = ["-", "-", params + engine.param_note, "-", "-", "-", engine.error]
            out.append([engine.engine, engine.variant, compile_cell, *cells])
            continue
        mine, row = summary[engine.key], rows[engine.key]
        out.append(
            [
                engine.engine,
                engine.variant,
                compile_cell,
                pair({p: mine[p]["prefill_tok_s"] for p in PROMPTS}),
                pair({p: mine[p]["decode_tok_s"] for p in PROMPTS}),
                params + engine.param_note,
                pair(row["vs_hf"], 2, "x") if engine.family else "-",
                pair(row["vs_llama"], 2, "x") if engine.key != LLAMA_KEY else "-",
                same_tokens_cell(row["first_token_difference"]),
                ", ".join(engine.notes) or "-",
            ]
        )
    return out


# ---- main --------------------------------------------------------------------------


def load_engines(
    args: argparse.Namespace, workdir: Path, gguf: Path, banned: list[int]
) -> list[Engine]:
    engines = [
        guarded(partial(hf_engine, gguf, d, banned), Engine(f"hf-{d}", "HF generate", d, d))
        for d in HF_DTYPES
    ]
    for variant, dtype in package_variants(args.int4_group_size):
        failure, package = None, None
        try:
            package = single_stage.ensure_package(workdir, variant)
            failure = single_stage.probe_package(package, dtype)
        except Exception as error:  # noqa: BLE001 - report the variant, go on
            failure = f"build failed: {type(error).__name__}: {error}"
        for mode in row_modes(args):
            for compile in (False, True) if args.compile_variants else (False,):
                row = mesh_row(variant, dtype, compile, mode)
                if failure is not None or package is None:
                    row.error = failure
                    engines.append(row)
                else:
                    make = partial(mesh_engine, package, variant, dtype, compile, banned, mode)
                    engines.append(guarded(make, row))
    engines.append(guarded(partial(llama_engine, gguf, args.threads, banned), llama_row(gguf)))
    return engines


def row_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in str(args.row_invariant).split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("auto", "on", "off")]
    if unknown or not modes:
        raise SystemExit(f"--row-invariant takes auto, on, off (comma-separated), got {unknown}")
    return modes


def invariance_price(engines: Sequence[Engine], summary: dict) -> list[dict[str, Any]]:
    """Decode tok/s of each mesh row with row-invariant arithmetic over without."""
    price = []
    for engine in engines:
        if not engine.key.endswith("-ri-on"):
            continue
        off = engine.key.removesuffix("-ri-on") + "-ri-off"
        if off not in summary:
            continue
        entry: dict[str, Any] = {"row": engine.key.removesuffix("-ri-on")}
        for prompt in PROMPTS:
            entry[prompt] = common.ratio(
                summary[engine.key][prompt]["decode_tok_s"], summary[off][prompt]["decode_tok_s"]
            )
        price.append(entry)
    return price


def measure(
    engines: list[Engine], prompts: list[Prompt], args: argparse.Namespace
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Warm every row up, then run the repeats, rows in rotated order."""
    runs: dict[str, dict[str, list]] = {e.key: {p.name: [] for p in prompts} for e in engines}
    for engine in (e for e in engines if e.error is None):
        started = time.perf_counter()
        for prompt in prompts:
            attempt(engine, prompt, args.warmup_tokens, "warm-up")
        engine.notes.append(f"warm-up {time.perf_counter() - started:.1f}s")
        if engine.still_compiled is not None and not engine.still_compiled():
            engine.notes.append("compile fell back to eager")
    for repeat in range(args.repeats):
        for engine in common.rotated([e for e in engines if e.error is None], repeat):
            for prompt in prompts:
                generation = attempt(engine, prompt, args.tokens, "run")
                if generation is not None:
                    figures = generation_figures(generation, len(prompt.ids))
                    runs[engine.key][prompt.name].append(figures)
        logger.warning("repeat %d/%d done", repeat + 1, args.repeats)
    return runs


def attempt(engine: Engine, prompt: Prompt, tokens: int, what: str) -> Generation | None:
    """One generation; a failure marks the row failed (and skips it from then on)."""
    if engine.error is not None or engine.run is None:
        return None
    try:
        return engine.run(prompt.ids, tokens)
    except Exception as error:  # noqa: BLE001 - one failing row must not end the run
        logger.warning("%s %s failed: %s", engine.key, what, error, exc_info=True)
        engine.error = f"{what} failed: {type(error).__name__}: {error}"
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common.configure(args)
    if args.tokens < 2 or args.code_tokens < 16:
        raise SystemExit("--tokens must be at least 2 and --code-tokens at least 16")
    import torch
    from transformers import AutoTokenizer

    from mesh.package.embedded import default_gguf_path

    torch.set_num_threads(args.threads)
    load_start = common.load_average()
    gguf = default_gguf_path()
    workloads = common.load_workloads(args.workloads or common.default_workloads_path())
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as scratch:
        workdir = (args.workdir or Path(scratch)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        dense = single_stage.ensure_package(workdir, PackageVariant("float32"))
        prompts = build_prompts(AutoTokenizer.from_pretrained(dense), workloads, args.code_tokens)
        engines = load_engines(args, workdir, gguf, single_stage.package_eos_ids(dense))
        runs = measure(engines, prompts, args)
    summary = {e.key: summarize(runs[e.key]) for e in engines}
    rows = {e.key: compare(e, summary, args.check_tokens) for e in engines}
    gguf_bytes = gguf.stat().st_size
    goal_list = goals(engines, rows, gguf_bytes)
    header = (
        f"{gguf.name}: chat prompt {len(prompts[0].ids)} tokens, code prompt "
        f"{len(prompts[1].ids)} tokens, {args.tokens} new tokens, median of "
        f"{args.repeats}, {args.threads} threads"
    )
    common.emit(
        "\n".join(
            [header, "", common.render_table(TABLE_HEADERS, table_rows(engines, summary, rows))]
            + goal_lines(engines, goal_list, gguf_bytes)
        )
    )
    payload = {
        "benchmark": "engine",
        "command": common.command_line(),
        "machine": common.machine_info(args.threads),
        "load_average_start": load_start,
        "load_average_end": common.load_average(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "gguf": {"file": gguf.name, "bytes": gguf_bytes},
        "int4_param_bytes_over_gguf": int4_over_gguf(engines, gguf_bytes),
        "prompts": [{"name": p.name, "source": p.source, "tokens": len(p.ids)} for p in prompts],
        "engines": [engine_json(e, summary, rows, runs) for e in engines],
        "goals": goal_list,
    }
    price = invariance_price(engines, summary)
    if price:
        payload["row_invariance_price"] = price
        common.emit("\ndecode tok/s, row-invariant on / off (medians)")
        common.emit(
            common.render_table(
                ["mesh row", *PROMPTS],
                [[p["row"], *(common.fmt(p[name], 3) for name in PROMPTS)] for p in price],
            )
        )
    common.write_json(args.out, payload)
    common.emit(f"\nwrote {args.out}")
    return 0


def goal_lines(engines: Sequence[Engine], goal_list: list[dict], gguf_bytes: int) -> list[str]:
    lines = [
        "",
        f"GGUF file {gguf_bytes / 1e6:.1f} MB; int4 parameter bytes / GGUF file size "
        f"{common.fmt(int4_over_gguf(engines, gguf_bytes))}",
    ]
    for goal in goal_list:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        lines.append(f"goal: {goal['goal']}: {common.fmt(goal['value'])} -> {verdict}")
    return lines


def engine_json(engine: Engine, summary: dict, rows: dict, runs: dict) -> dict[str, Any]:
    return {
        "key": engine.key,
        "engine": engine.engine,
        "variant": engine.variant,
        "compile": engine.compile,
        "param_bytes": engine.param_bytes,
        "error": engine.error,
        "notes": engine.notes,
        "medians": summary[engine.key],
        "comparison": rows[engine.key],
        "runs": runs[engine.key],
    }


if __name__ == "__main__":
    raise SystemExit(main())
