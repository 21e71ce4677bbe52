"""A stage's step by the rows it holds, with one of the stage's own kernels against
torch, in one process and one runtime, alternating repeat by repeat: the attention
kernel (mesh/runtime/native_attention.py) against torch's SDPA per segment
(``--compare attention``, the default), the RMSNorm kernel
(mesh/runtime/native_norm.py) against torch's four operations (``--compare norm``),
the quantised kernels with their weight prefetch hints against the same kernels
without them (``--compare prefetch``: "torch" then stands for the kernels without
hints), or the stage's layers in one call of the C loop
(mesh/runtime/native_layers.py) against layer by layer in Python (``--compare
layers``), or the quantised kernels with AMX tiles from the default row counts
(``native.AMX_ROWS_INT4``, ``AMX_ROWS_INT8``) against VNNI alone (``--compare
amx``).

Frames: decode rows of 1-16 sessions (each at its own position around 300), verify
windows of 8 and 16 rows, prefill chunks of 128 and 512 rows, through the layers
and head of a package loaded as one stage (row-invariant arithmetic, as the int4 and
int8 packages run by default). Prints milliseconds per step (medians of the
repeats), the ratio native / torch, and how each grows with rows; writes JSON.

    .venv/bin/python benchmarks/step_bench.py --package PKG [--threads 1] [--repeats 5]
        [--compare attention|norm|prefetch|layers|amx]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import emit, machine_info, render_table, resolve_package, write_json

from mesh.package.manifest import PackageManifest
from mesh.runtime import (
    Span,
    StageRuntime,
    invariant,
    load_stage_runtime,
    native,
    native_attention,
    native_norm,
)
from mesh.types import LayerRange

logger = logging.getLogger("step_bench")

KERNELS = ("torch", "native")


def _switch_usable(module: Any) -> Callable[[bool], None]:
    """Turn a kernel on or off through its module's ``usable`` check."""
    usable = module.usable

    def switch(on: bool) -> None:
        module.usable = usable if on else _never

    return switch


def _switch_prefetch(on: bool) -> None:
    lib = native.library()
    assert lib is not None
    lib.mesh_set_fetch_ahead(native.FETCH_AHEAD_BYTES if on else 0)


def _switch_amx(on: bool) -> None:
    if not native.amx():
        raise SystemExit("AMX tiles are not granted on this CPU")
    if on:
        native.set_amx_rows()
    else:
        native.set_amx_rows(0, 0)


def _switch_layers(runtime: StageRuntime) -> Callable[[bool], None]:
    if not runtime.native_layers:
        raise SystemExit("this stage's layers do not run on the C loop (see native_layers)")

    def switch(on: bool) -> None:
        runtime.set_native_layers(on)

    return switch


# What --compare switches (given the runtime): on = the stage as it runs by default.
COMPARED: dict[str, Callable[[StageRuntime], Callable[[bool], None]]] = {
    "attention": lambda _: _switch_usable(native_attention),
    "norm": lambda _: _switch_usable(native_norm),
    "prefetch": lambda _: _switch_prefetch,
    "amx": lambda _: _switch_amx,
    "layers": _switch_layers,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-layer", type=int, default=0, help="the stage's first layer")
    parser.add_argument(
        "--compare",
        choices=sorted(COMPARED),
        default="attention",
        help="which of the stage's kernels runs against torch",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/step_bench.json"))
    return parser.parse_args(argv)


class Steps:
    """Frames through one runtime; sessions prefilled once per case."""

    def __init__(self, runtime: StageRuntime, first_stage: bool, hidden: int) -> None:
        self.runtime, self.first_stage, self.hidden = runtime, first_stage, hidden
        self.ids = [random.Random(i).randrange(1000, 40000) for i in range(1200)]
        self.count = 0

    def _inputs(self, rows: int, start: int) -> torch.Tensor:
        if self.first_stage:
            return torch.tensor(self.ids[start : start + rows], dtype=torch.long)
        generator = torch.Generator().manual_seed(start)
        return torch.randn(rows, self.hidden, generator=generator)

    def frame(self, parts: list[tuple[str, int, int]]) -> None:
        spans = [Span(name, at, rows) for name, at, rows in parts]
        inputs = torch.cat([self._inputs(rows, at) for _, at, rows in parts])
        out = self.runtime.forward_batch(spans, inputs)
        if out.errors:
            raise RuntimeError(f"refused segments: {out.errors}")

    def session(self, length: int) -> str:
        self.count += 1
        name = f"s{self.count}"
        if length:
            self.frame([(name, 0, length)])
        return name

    def cases(self) -> dict[str, tuple[int, Callable[[], None]]]:
        """Name -> (rows, one step)."""

        def decode(sessions: int) -> tuple[int, Callable[[], None]]:
            held = [(self.session(260 + 16 * i), 260 + 16 * i) for i in range(sessions)]
            return sessions, lambda: self.frame([(name, at, 1) for name, at in held])

        def window(width: int) -> tuple[int, Callable[[], None]]:
            name = self.session(300)
            return width, lambda: self.frame([(name, 300, width)])

        def prefill(rows: int) -> tuple[int, Callable[[], None]]:
            name = self.session(0)
            return rows, lambda: self.frame([(name, 0, rows)])

        return {
            "decode x1": decode(1),
            "decode x4": decode(4),
            "decode x8": decode(8),
            "decode x16": decode(16),
            "verify 8": window(8),
            "verify 16": window(16),
            "prefill 128": prefill(128),
            "prefill 512": prefill(512),
        }


def measure(steps: Steps, repeats: int, compare: str = "attention") -> dict[str, dict[str, Any]]:
    cases = steps.cases()
    switch = COMPARED[compare](steps.runtime)
    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in KERNELS} for c in cases}
    try:
        for repeat in range(repeats):
            for kernel in KERNELS if repeat % 2 == 0 else KERNELS[::-1]:
                switch(kernel == "native")
                for name, (rows, step) in cases.items():
                    count = 2 if rows >= 128 else 12
                    step()  # warm
                    started = time.perf_counter()
                    for _ in range(count):
                        step()
                    times[name][kernel].append((time.perf_counter() - started) / count)
    finally:
        switch(True)
    one = {k: statistics.median(times["decode x1"][k]) for k in KERNELS}
    return {
        name: {"rows": cases[name][0]}
        | {f"{k}_ms": 1e3 * statistics.median(t[k]) for k in KERNELS}
        | {f"{k}_vs_one_row": statistics.median(t[k]) / one[k] for k in KERNELS}
        | {"native_over_torch": statistics.median(t["native"]) / statistics.median(t["torch"])}
        for name, t in times.items()
    }


def _never(*_: object) -> bool:
    return False


def table(results: dict[str, dict[str, Any]], compare: str = "attention") -> str:
    names = {
        "prefetch": ("no hints", "hints"),
        "layers": ("python layers", "C loop"),
        "amx": ("VNNI only", "AMX rule"),
    }
    off, on = names.get(compare, (f"torch {compare}", "native"))
    headers = ["frame", "rows", f"{off} ms", f"{on} ms", f"{on} / {off.split()[0]}"]
    headers += [f"{off.split()[0]} vs 1 row", f"{on} vs 1 row"]
    body = [
        [
            name,
            str(r["rows"]),
            f"{r['torch_ms']:.2f}",
            f"{r['native_ms']:.2f}",
            f"{r['native_over_torch']:.2f}",
            f"{r['torch_vs_one_row']:.2f}x",
            f"{r['native_vs_one_row']:.2f}x",
        ]
        for name, r in results.items()
    ]
    return render_table(headers, body)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    invariant.MODE = "on"
    if not native_attention.usable(torch.zeros(1, 64), 64, 1):
        raise SystemExit("the stage's own kernels are not available here (see the log)")
    package = resolve_package(args.package)
    manifest = PackageManifest.load(package)
    layers = LayerRange(args.first_layer, manifest.layer_count)
    runtime = load_stage_runtime(package, layers, max_sessions=64)
    steps = Steps(runtime, args.first_layer == 0, manifest.hidden_size)
    results = measure(steps, args.repeats, args.compare)
    emit(table(results, args.compare))
    write_json(
        args.out,
        {"machine": machine_info(args.threads), "package": str(package), "layers": str(layers)}
        | {"compare": args.compare, "results": results},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
