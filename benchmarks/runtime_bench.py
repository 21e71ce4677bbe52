"""Stage runtime benchmark on SmolLM2-135M (float32, CPU by default).

Measures, in one process and interleaved repeat by repeat:

- greedy decode tokens/s of HF ``model.generate`` (the unsplit model, loaded from the
  GGUF by transformers);
- greedy decode tokens/s of one ``StageRuntime`` holding the whole model, and of a
  2-way split driven in the same process (no network);
- load time and parameter bytes of each stage of the 2-way split.

Decode rate counts the tokens after the first one, over the time from the first
token to the last, so prefill is excluded on both sides; end-to-end rate (prefill
included) is reported too. Prints a table and writes JSON (``--out``).

    .venv/bin/python benchmarks/runtime_bench.py [--tokens 64] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from mesh.package.builder import build_package
from mesh.package.default import build_default_package
from mesh.package.embedded import default_gguf_path
from mesh.runtime import StageRuntime, load_stage_runtime
from mesh.types import LayerRange

logger = logging.getLogger("runtime_bench")

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


class TokenClock(BaseStreamer):
    """Records when generate emits each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        return None


def run_generate(model: PreTrainedModel, prompt: torch.Tensor, tokens: int) -> dict:
    clock = TokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            prompt.unsqueeze(0),
            attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            streamer=clock,
        )
    return _timing(started, clock.stamps, output[0, prompt.shape[0] :].tolist())


def run_stages(stages: list[StageRuntime], prompt: torch.Tensor, tokens: int, eos: set[int]):
    """Greedy decode through a chain of runtimes; EOS is held back until ``tokens``
    tokens exist, as generate's ``min_new_tokens`` does."""
    session = f"bench-{time.monotonic_ns()}"
    stamps: list[float] = []
    emitted: list[int] = []
    started = time.perf_counter()
    activations, pos = prompt, 0
    while True:
        for stage in stages:
            activations = stage.forward(session, pos, activations)
        scores = activations[-1]
        if eos and len(emitted) < tokens - 1:
            scores = scores.clone()
            scores[list(eos)] = float("-inf")
        token = int(scores.argmax())
        stamps.append(time.perf_counter())
        emitted.append(token)
        if len(emitted) == tokens:
            break
        pos += activations.shape[0]
        activations = torch.tensor([token])
    for stage in stages:
        stage.drop_session(session)
    return _timing(started, stamps, emitted)


def _timing(started: float, stamps: list[float], emitted: list[int]) -> dict:
    decode_s = stamps[-1] - stamps[0]
    return {
        "tokens": emitted,
        "total_s": stamps[-1] - started,
        "first_token_s": stamps[0] - started,
        "decode_tok_s": (len(stamps) - 1) / decode_s if decode_s > 0 else float("nan"),
        "end_to_end_tok_s": len(stamps) / (stamps[-1] - started),
    }


def load_split(package: Path, ranges: list[LayerRange]) -> tuple[list[StageRuntime], list[dict]]:
    stages, rows = [], []
    for layer_range in ranges:
        started = time.perf_counter()
        stage = load_stage_runtime(package, layer_range)
        rows.append(
            {
                "layer_range": str(layer_range),
                "load_s": time.perf_counter() - started,
                "param_bytes": stage.param_bytes,
            }
        )
        stages.append(stage)
    return stages, rows


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)"
    )
    parser.add_argument(
        "--package",
        type=Path,
        default=None,
        help="package built from that GGUF (default: the cached default package for SmolLM2, "
        "or a fresh build in a temporary directory for --gguf)",
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-results/runtime_bench.json"))
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the figures are medians)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gguf = args.gguf or default_gguf_path()

    with tempfile.TemporaryDirectory(prefix="runtime-bench-") as scratch:
        package = args.package
        if package is None and args.gguf is None:
            package = build_default_package()
        elif package is None:
            package = Path(scratch) / "package"
            logger.info("building a package from %s", gguf)
            build_package(str(gguf), package)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        prompt = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        layer_count = model.config.num_hidden_layers
        half = layer_count // 2
        split, split_rows = load_split(
            package, [LayerRange(0, half), LayerRange(half, layer_count)]
        )
        whole, whole_rows = load_split(package, [LayerRange(0, layer_count)])

        contenders: dict[str, Callable[[], dict]] = {
            "hf_generate": lambda: run_generate(model, prompt, args.tokens),
            "runtime_whole": lambda: run_stages(whole, prompt, args.tokens, eos_ids),
            "runtime_split2": lambda: run_stages(split, prompt, args.tokens, eos_ids),
        }
        for run in contenders.values():  # warm-up
            run()
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for repeat in range(args.repeats):
            for name, run in contenders.items():
                runs[name].append(run())
            logger.info("repeat %d/%d done", repeat + 1, args.repeats)

    reference = runs["hf_generate"][0]["tokens"]
    summary = {
        name: {
            "decode_tok_s": median_of(results, "decode_tok_s"),
            "end_to_end_tok_s": median_of(results, "end_to_end_tok_s"),
            "first_token_s": median_of(results, "first_token_s"),
            "tokens_equal_generate": all(r["tokens"] == reference for r in results),
            "decode_tok_s_runs": [r["decode_tok_s"] for r in results],
        }
        for name, results in runs.items()
    }
    base = summary["hf_generate"]["decode_tok_s"]
    for entry in summary.values():
        entry["decode_speedup_vs_generate"] = entry["decode_tok_s"] / base
    report = {
        "model": gguf.name,
        "dtype": "float32",
        "device": "cpu",
        "prompt_tokens": int(prompt.shape[0]),
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "decode": summary,
        "split_stages": split_rows,
        "whole_stage": whole_rows[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    write_table(report)
    sys.stdout.write(f"\nwrote {args.out}\n")
    return 0


def write_table(report: dict) -> None:
    out = sys.stdout
    out.write(
        f"\n{report['model']} fp32, {report['prompt_tokens']} prompt tokens, "
        f"{report['new_tokens']} new tokens, median of {report['repeats']}, "
        f"{report['torch_threads']} torch threads\n\n"
    )
    out.write(f"{'contender':<16}{'decode tok/s':>14}{'e2e tok/s':>12}{'vs generate':>13}")
    out.write(f"{'same tokens':>13}\n")
    for name, entry in report["decode"].items():
        out.write(
            f"{name:<16}{entry['decode_tok_s']:>14.2f}{entry['end_to_end_tok_s']:>12.2f}"
            f"{entry['decode_speedup_vs_generate']:>12.3f}x{str(entry['tokens_equal_generate']):>13}\n"
        )
    out.write(f"\n{'stage':<12}{'load s':>10}{'param MiB':>12}\n")
    for row in [*report["split_stages"], report["whole_stage"]]:
        out.write(
            f"{row['layer_range']:<12}{row['load_s']:>10.3f}{row['param_bytes'] / 2**20:>12.1f}\n"
        )


if __name__ == "__main__":
    raise SystemExit(main())
