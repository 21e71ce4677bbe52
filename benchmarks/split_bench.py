"""What splitting a model costs its compute, apart from the hop: in one process and
on one thread, a decode step through the whole model as one runtime against the
same layers as two runtimes (first half, then second half and head) run one after
the other; then each half's step time when it follows an idle gap, as it does in a
2-stage mesh where a stage waits while the other computes (sleeping, or spinning on
the clock so that the core never idles).

If the two halves back to back cost what the whole costs, the split itself adds no
compute; if a half costs more after a gap, what a stage loses in a mesh is the
state its caches lose while it waits, not the split.

    .venv/bin/python benchmarks/split_bench.py --package PKG [--threads 1]
        [--repeats 15] [--gaps-ms 0 5 25]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import emit, machine_info, render_table, resolve_package, write_json

from mesh.package.manifest import PackageManifest
from mesh.runtime import Span, StageRuntime, load_stage_runtime
from mesh.types import LayerRange

PROMPT_TOKENS = 100
STEPS_PER_SAMPLE = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--gaps-ms", type=float, nargs="+", default=[0.0, 5.0, 25.0], help="idle gaps"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/split_bench.json"))
    return parser.parse_args(argv)


class Split:
    """The whole model, and its two halves, each with one session holding a prompt."""

    def __init__(self, package: Path) -> None:
        manifest = PackageManifest.load(package)
        count, half = manifest.layer_count, manifest.layer_count // 2
        self.layers = (count, half)
        self.whole = load_stage_runtime(package, LayerRange(0, count), max_sessions=4)
        self.first = load_stage_runtime(package, LayerRange(0, half), max_sessions=4)
        self.second = load_stage_runtime(package, LayerRange(half, count), max_sessions=4)
        prompt = torch.arange(1000, 1000 + PROMPT_TOKENS)
        self._run(self.whole, 0, prompt)
        self._run(self.second, 0, self._run(self.first, 0, prompt))
        self.token = torch.tensor([1234])
        self.hidden = self._run(self.first, PROMPT_TOKENS, self.token)
        # The halves are the same model: their logits are the whole's (to rounding).
        whole = self._run(self.whole, PROMPT_TOKENS, self.token)
        halves = self._run(self.second, PROMPT_TOKENS, self.hidden)
        self.logit_difference = float((whole - halves).abs().max())
        self.logit_scale = float(whole.abs().max())

    @staticmethod
    def _run(runtime: StageRuntime, at: int, inputs: torch.Tensor) -> torch.Tensor:
        out = runtime.forward_batch([Span("s", at, len(inputs))], inputs)
        if out.errors or out.rows is None:
            raise RuntimeError(f"step refused: {out.errors}")
        return out.rows

    def step_whole(self) -> None:
        self._run(self.whole, PROMPT_TOKENS, self.token)

    def step_first(self) -> None:
        self._run(self.first, PROMPT_TOKENS, self.token)

    def step_second(self) -> None:
        self._run(self.second, PROMPT_TOKENS, self.hidden)

    def step_split(self) -> None:
        self._run(self.second, PROMPT_TOKENS, self._run(self.first, PROMPT_TOKENS, self.token))


def _ms(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1000


def _back_to_back(step: Callable[[], None]) -> float:
    step()
    started = time.perf_counter()
    for _ in range(STEPS_PER_SAMPLE):
        step()
    return (time.perf_counter() - started) * 1000 / STEPS_PER_SAMPLE


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(split: Split, repeats: int, gaps_ms: Sequence[float]) -> dict[str, Any]:
    """Medians in ms: back to back (whole, split, each half), then each half after
    every gap, sleeping and spinning, the halves alternating as in a mesh."""
    samples: dict[str, list[float]] = {}
    cases = {"whole": split.step_whole, "split": split.step_split}
    cases |= {"first half": split.step_first, "second half": split.step_second}
    for _ in range(repeats):
        for name, step in cases.items():
            samples.setdefault(name, []).append(_back_to_back(step))
    gapped: dict[str, dict[str, float]] = {}
    for gap in gaps_ms:
        for how, wait in (("sleep", time.sleep), ("spin", _spin)):
            if gap == 0 and how == "spin":
                continue
            first, second = [], []
            for _ in range(repeats * 3):
                first.append(_ms(split.step_first))
                wait(gap / 1000)
                second.append(_ms(split.step_second))
                wait(gap / 1000)
            gapped[f"{gap:g} ms {how}"] = {
                "first half ms": round(statistics.median(first), 3),
                "second half ms": round(statistics.median(second), 3),
            }
    return {
        "back_to_back_ms": {k: round(statistics.median(v), 3) for k, v in samples.items()},
        "after_gap": gapped,
    }


def tables(results: dict[str, Any]) -> str:
    steps = results["back_to_back_ms"]
    whole = steps["whole"]
    first = render_table(
        ["step, back to back", "ms", "vs whole"],
        [[name, f"{ms:.2f}", f"{ms / whole:.3f}"] for name, ms in steps.items()],
    )
    base = results["after_gap"].get("0 ms sleep")
    rows = []
    for name, halves in results["after_gap"].items():
        cells = [name]
        for part in ("first half ms", "second half ms"):
            ratio = f" ({halves[part] / base[part]:.2f}x)" if base else ""
            cells.append(f"{halves[part]:.2f}{ratio}")
        rows.append(cells)
    second = render_table(["gap between the halves", "first half ms", "second half ms"], rows)
    return f"{first}\n\n{second}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    package = resolve_package(args.package)
    split = Split(package)
    results = measure(split, args.repeats, args.gaps_ms)
    emit(
        f"split benchmark: {package.name}, layers {split.layers[0]} (halves at "
        f"{split.layers[1]}); logits of the halves vs the whole: largest difference "
        f"{split.logit_difference:.2e} of {split.logit_scale:.2f}"
    )
    emit(tables(results))
    payload = {"machine": machine_info(args.threads), "package": str(package)}
    payload |= {"max_logit_difference": split.logit_difference, "logit_scale": split.logit_scale}
    write_json(args.out, payload | {"repeats": args.repeats} | results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
