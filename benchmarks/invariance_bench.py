"""Row invariance: does a token's result depend on what else runs with it, and what
does making it not depend cost?

Two parts, each run with row-invariant arithmetic off (the previous kernels: torch's
SDPA, untiled GEMMs) and on (mesh/runtime/invariant.py), in one process, one
``StageRuntime`` holding every layer, 1 torch thread:

**Divergence.** Every prompt is first run *alone*: its prompt in one frame, then
``--tokens`` greedy tokens one per frame; that gives the reference token and logits
of every generated position. Then the same tokens are fed again (teacher forcing,
so every position is comparable) in other frames:

- ``batch-B``: B sessions at their own positions in every frame (B = 2, 4, 8, 16),
  prompts prefilled together, then one decode segment per session per frame;
- ``window-W``: the generated tokens of one session in verify segments of W rows
  (W = 2, 4, 8, 16), as speculation sends them;
- ``prefill-48``: the prompt in chunks of 48 tokens (a step budget cutting it),
  then one token per frame.

Per (package, arithmetic, scenario): the share of rows whose logits are bit-identical
to the reference, the largest absolute logit difference, and *flips*: positions
where the argmax differs from the reference token, i.e. where greedy text would
change from there on. Packages: SmolLM2-135M-Instruct as float32, bfloat16, int8
and int4 (built from the default GGUF under ``--workdir``), prompts the workload
file's plus the built-in ones below; and a tiny random Llama in the same four
formats, on random token ids.

**Price.** Per SmolLM2 package: one session's decode step, a step of 8 sessions'
decode rows, a verify window of 8 rows, and a 512-token prefill, timed with the
arithmetic off and on in alternating repeats (medians); the ratio on / off is the
cost (above 1: slower).

Prints tables, writes JSON (``--out``).

    .venv/bin/python benchmarks/invariance_bench.py [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import common
import single_stage
import torch

from mesh.runtime import Span, StageRuntime, invariant, load_stage_runtime
from mesh.types import LayerRange

logger = logging.getLogger("bench")

SCENARIOS = ("batch-2", "batch-4", "batch-8", "batch-16", "window-2", "window-4", "window-8")
SCENARIOS += ("window-16", "prefill-48")
PACKAGE_VARIANTS = {
    "float32": single_stage.PackageVariant("float32"),
    "bfloat16": single_stage.PackageVariant("bfloat16"),
    "int8": single_stage.PackageVariant("bfloat16", "int8"),
    "int4": single_stage.PackageVariant("bfloat16", "int4", 32),
}
# Prompts of our own beside the workload file's (a code edit, a refactor, chat).
OWN_PROMPTS = (
    "Rename the function `load_rows` to `read_rows` everywhere in this module and "
    "return the whole file:\n\nimport csv\n\n\ndef load_rows(path):\n    with open(path) "
    "as handle:\n        return list(csv.reader(handle))\n\n\ndef count(path):\n    "
    "return len(load_rows(path))\n",
    "Rewrite this loop as a list comprehension and explain the change in one "
    "sentence:\n\nresult = []\nfor item in items:\n    if item.ready:\n        "
    "result.append(item.name.upper())\n",
    "What are three things to check before replacing the fan of a desktop computer?",
    "Write a short, friendly reply declining an invitation to a meeting on Friday.",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="generated tokens per prompt")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per package (<= 16)")
    parser.add_argument("--prompt-tokens", type=int, default=320, help="longest prompt")
    parser.add_argument("--repeats", type=int, default=3, help="price repeats (median)")
    parser.add_argument("--formats", default="float32,bfloat16,int8,int4")
    parser.add_argument("--skip-price", action="store_true")
    parser.add_argument("--skip-divergence", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true")
    single_stage.add_output_arguments(parser, "invariance")
    args = parser.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(args.formats) - set(PACKAGE_VARIANTS))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {sorted(PACKAGE_VARIANTS)}")
    return args


# ---- running frames ----------------------------------------------------------------


class Runner:
    """Frames through one runtime, with fresh session names per run."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.count = 0

    def fresh(self) -> str:
        self.count += 1
        return f"s{self.count}"

    def frame(self, parts: list[tuple[str, int, list[int]]]) -> list[torch.Tensor]:
        """One frame of ``(session, pos_start, token ids)`` segments: each one's logits."""
        spans = [Span(s, pos, len(ids)) for s, pos, ids in parts]
        ids = torch.tensor([t for _, _, row in parts for t in row], dtype=torch.long)
        out = self.runtime.forward_batch(spans, ids)
        if out.errors:
            raise RuntimeError(f"refused segments: {out.errors}")
        return [out.of(i) for i in range(len(parts))]

    def end(self, sessions: Sequence[str]) -> None:
        for session in sessions:
            self.runtime.drop_session(session)


def reference(runner: Runner, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """Alone: the prompt in one frame, then greedy tokens one per frame. Returns the
    generated tokens and the logits ``[tokens, vocab]`` that chose them."""
    session = runner.fresh()
    logits = [runner.frame([(session, 0, prompt)])[0][-1]]
    generated = []
    for _ in range(tokens):
        token = int(logits[-1].argmax())
        generated.append(token)
        if len(generated) == tokens:
            break
        logits.append(runner.frame([(session, len(prompt) + len(generated) - 1, [token])])[0][0])
    runner.end([session])
    return generated, torch.stack(logits)


def batched(
    runner: Runner, prompts: list[list[int]], answers: list[list[int]]
) -> list[torch.Tensor]:
    """The prompts prefilled in one frame, then every session's next answer token in
    one frame per step: each prompt's logits ``[tokens, vocab]``."""
    sessions = [runner.fresh() for _ in prompts]
    first = runner.frame([(s, 0, p) for s, p in zip(sessions, prompts, strict=True)])
    rows: list[list[torch.Tensor]] = [[logits[-1]] for logits in first]
    for step in range(len(answers[0]) - 1):
        parts = [
            (s, len(p) + step, [a[step]])
            for s, p, a in zip(sessions, prompts, answers, strict=True)
        ]
        for index, logits in enumerate(runner.frame(parts)):
            rows[index].append(logits[0])
    runner.end(sessions)
    return [torch.stack(r) for r in rows]


def windowed(runner: Runner, prompt: list[int], answer: list[int], width: int) -> torch.Tensor:
    """The prompt alone, then the answer fed in verify segments of ``width`` rows."""
    session = runner.fresh()
    rows = [runner.frame([(session, 0, prompt)])[0][-1]]
    fed = answer[:-1]
    for first in range(0, len(fed), width):
        chunk = fed[first : first + width]
        rows.extend(runner.frame([(session, len(prompt) + first, chunk)])[0])
    runner.end([session])
    return torch.stack(rows)


def chunked_prefill(
    runner: Runner, prompt: list[int], answer: list[int], chunk: int
) -> torch.Tensor:
    """The prompt in chunks of ``chunk`` tokens, then the answer one token per frame."""
    session = runner.fresh()
    last = None
    for first in range(0, len(prompt), chunk):
        last = runner.frame([(session, first, prompt[first : first + chunk])])[0][-1]
    rows = [last]
    for step, token in enumerate(answer[:-1]):
        rows.append(runner.frame([(session, len(prompt) + step, [token])])[0][0])
    runner.end([session])
    return torch.stack(rows)


def compare(got: torch.Tensor, want: torch.Tensor, answer: list[int]) -> dict[str, float]:
    identical = sum(bool(torch.equal(g, w)) for g, w in zip(got, want, strict=True))
    flips = sum(int(g.argmax()) != token for g, token in zip(got, answer, strict=True))
    return {
        "rows": len(answer),
        "identical_rows": identical,
        "max_abs_diff": float((got - want).abs().max()),
        "flips": flips,
    }


def divergence(
    runtime: StageRuntime, prompts: list[list[int]], tokens: int
) -> dict[str, dict[str, Any]]:
    """Every scenario's comparison with the prompts run alone."""
    runner = Runner(runtime)
    refs = [reference(runner, p, tokens) for p in prompts]
    answers = [a for a, _ in refs]
    wants = [w for _, w in refs]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SCENARIOS}
    for size in (2, 4, 8, 16):
        # Every prompt in at least one batch; a batch larger than what is left wraps
        # round to the first prompts (as separate sessions of their own).
        for first in range(0, len(prompts), size):
            group = [(first + i) % len(prompts) for i in range(size)]
            got = batched(runner, [prompts[i] for i in group], [answers[i] for i in group])
            for index, logits in zip(group, got, strict=True):
                results[f"batch-{size}"].append(compare(logits, wants[index], answers[index]))
    for width in (2, 4, 8, 16):
        for prompt, answer, want in zip(prompts, answers, wants, strict=True):
            got = windowed(runner, prompt, answer, width)
            results[f"window-{width}"].append(compare(got, want, answer))
    for prompt, answer, want in zip(prompts, answers, wants, strict=True):
        results["prefill-48"].append(
            compare(chunked_prefill(runner, prompt, answer, 48), want, answer)
        )
    return {name: summarise(rows) for name, rows in results.items() if rows}


def summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    total = sum(r["rows"] for r in rows)
    return {
        "requests": len(rows),
        "rows": total,
        "identical_fraction": sum(r["identical_rows"] for r in rows) / total,
        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
        "flips": sum(r["flips"] for r in rows),
        "requests_with_a_flip": sum(1 for r in rows if r["flips"]),
    }


# ---- inputs --------------------------------------------------------------------------


def smollm2_prompts(package: Path, args: argparse.Namespace) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package)
    path = args.workloads or common.default_workloads_path()
    messages = [list(r.messages) for rs in common.load_workloads(path).values() for r in rs]
    messages += [[{"role": "user", "content": text}] for text in OWN_PROMPTS]
    prompts = []
    for convo in messages[: args.prompts]:
        head, tail = single_stage.chat_prompt_parts(tokenizer, convo)
        prompts.append(single_stage.fit_prompt(head, tail, args.prompt_tokens))
    return prompts


def tiny_package(workdir: Path, fmt: str) -> Path:
    """A tiny random Llama (hidden 64, 4 layers) packaged in ``fmt``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mesh.package.builder import build_package
    from mesh.package.manifest import MANIFEST_NAME

    source = workdir / "tiny-llama"
    if not (source / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        LlamaForCausalLM(config).eval().save_pretrained(source)
    out = workdir / f"tiny-llama-{fmt}"
    if not (out / MANIFEST_NAME).is_file():
        variant = PACKAGE_VARIANTS[fmt]
        build_package(
            str(source),
            out,
            dtype=variant.dtype,
            quant=variant.quant,
            group_size=variant.group_size,
        )
    return out


def tiny_prompts(count: int, longest: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4096) for _ in range(rng.randint(8, longest))] for _ in range(count)]


# ---- price ------------------------------------------------------------------------------


def price(package: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Seconds per call of each shape with the arithmetic off and on (one runtime
    each, loaded with the setting: it also picks the KV cache's dtype), alternating."""
    ids = [random.Random(i).randrange(1000, 40000) for i in range(600)]
    cases: dict[str, dict[str, Callable[[], None]]] = {}
    for mode in ("off", "on"):
        invariant.MODE = mode
        runner = Runner(load(package))
        for name, call in price_cases(runner, ids).items():
            cases.setdefault(name, {})[mode] = call
    times: dict[str, dict[str, list[float]]] = {c: {"off": [], "on": []} for c in cases}
    for repeat in range(repeats):
        for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
            for name, calls in cases.items():
                call = calls[mode]
                call()  # warm
                count = 3 if name.startswith("prefill") else 24
                started = time.perf_counter()
                for _ in range(count):
                    call()
                times[name][mode].append((time.perf_counter() - started) / count)
    invariant.MODE = "auto"
    return {
        name: {
            "off_ms": 1e3 * statistics.median(t["off"]),
            "on_ms": 1e3 * statistics.median(t["on"]),
            "on_over_off": statistics.median(t["on"]) / statistics.median(t["off"]),
        }
        for name, t in times.items()
    }


def price_cases(runner: Runner, ids: list[int]) -> dict[str, Callable[[], None]]:
    """One session's decode step, 8 sessions' decode rows, a verify window of 8 and
    a 512-token prefill, each a callable running one frame (sessions prefilled)."""

    def decode(sessions: int) -> Callable[[], None]:
        names = [runner.fresh() for _ in range(sessions)]
        held = {name: 280 + 8 * index for index, name in enumerate(names)}
        for name in names:
            runner.frame([(name, 0, ids[: held[name]])])
        return lambda: runner.frame([(n, held[n], [ids[held[n]]]) for n in names]) and None

    def window(width: int) -> Callable[[], None]:
        name = runner.fresh()
        runner.frame([(name, 0, ids[:300])])
        return lambda: runner.frame([(name, 300, ids[300 : 300 + width])]) and None

    def prefill(count: int) -> Callable[[], None]:
        name = runner.fresh()
        return lambda: runner.frame([(name, 0, ids[:count])]) and None

    return {
        "decode x1": decode(1),
        "decode x8": decode(8),
        "verify 8": window(8),
        "prefill 512": prefill(512),
    }


# ---- main ---------------------------------------------------------------------------


def load(package: Path) -> StageRuntime:
    from mesh.package.manifest import PackageManifest

    layers = PackageManifest.load(package).layer_count
    return load_stage_runtime(package, LayerRange(0, layers), max_sessions=64)


def run_divergence(
    label: str, package: Path, prompts: list[list[int]], tokens: int
) -> list[dict[str, Any]]:
    rows = []
    for mode in ("off", "on"):
        invariant.MODE = mode
        started = time.perf_counter()
        for scenario, summary in divergence(load(package), prompts, tokens).items():
            rows.append({"package": label, "arithmetic": mode, "scenario": scenario, **summary})
        logger.warning("%s %s: %.0fs", label, mode, time.perf_counter() - started)
    invariant.MODE = "auto"
    return rows


def divergence_table(rows: list[dict[str, Any]]) -> str:
    headers = ["package", "scenario", "identical off", "on", "max |diff| off", "on"]
    headers += ["flips off", "on", "requests changed off", "on"]
    body = []
    keyed = {(r["package"], r["scenario"], r["arithmetic"]): r for r in rows}
    for package in dict.fromkeys(r["package"] for r in rows):
        for scenario in SCENARIOS:
            off, on = keyed.get((package, scenario, "off")), keyed.get((package, scenario, "on"))
            if off is None or on is None:
                continue
            body.append(
                [
                    package,
                    scenario,
                    f"{100 * off['identical_fraction']:.1f}%",
                    f"{100 * on['identical_fraction']:.1f}%",
                    f"{off['max_abs_diff']:.2g}",
                    f"{on['max_abs_diff']:.2g}",
                    f"{off['flips']}/{off['rows']}",
                    f"{on['flips']}/{on['rows']}",
                    f"{off['requests_with_a_flip']}/{off['requests']}",
                    f"{on['requests_with_a_flip']}/{on['requests']}",
                ]
            )
    return common.render_table(headers, body)


def price_table(prices: dict[str, dict[str, dict[str, float]]]) -> str:
    headers = ["package", "call", "previous ms", "invariant ms", "invariant / previous"]
    body = [
        [package, name, f"{p['off_ms']:.2f}", f"{p['on_ms']:.2f}", f"{p['on_over_off']:.3f}"]
        for package, calls in prices.items()
        for name, p in calls.items()
    ]
    return common.render_table(headers, body)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="invariance-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    prices: dict[str, dict[str, dict[str, float]]] = {}
    if not args.skip_tiny and not args.skip_divergence:
        prompts = tiny_prompts(args.prompts, 200)
        for fmt in args.formats:
            package = tiny_package(workdir, fmt)
            rows += run_divergence(f"tiny {fmt}", package, prompts, args.tokens)
    for fmt in args.formats:
        package = single_stage.ensure_package(workdir, PACKAGE_VARIANTS[fmt])
        if not args.skip_divergence:
            prompts = smollm2_prompts(package, args)
            rows += run_divergence(f"SmolLM2 {fmt}", package, prompts, args.tokens)
        if not args.skip_price:
            prices[f"SmolLM2 {fmt}"] = price(package, args.repeats)
    payload = {
        "benchmark": "invariance",
        "command": common.command_line(),
        "machine": common.machine_info(1),
        "settings": {
            "tokens": args.tokens,
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats,
            "duration_s": round(time.time() - started, 1),
        },
        "divergence": rows,
        "price": prices,
    }
    common.write_json(args.out, payload)
    if rows:
        common.emit(
            "divergence from each request run alone (teacher-forced; off: previous kernels)"
        )
        common.emit(divergence_table(rows))
    if prices:
        common.emit("\nprice of row-invariant arithmetic (1 thread, medians)")
        common.emit(price_table(prices))
    common.emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
