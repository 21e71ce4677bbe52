"""Decode frames of 1..32 sessions on one stage runtime: eager kernels against CUDA
graphs (one session's whole step, or the bucketed pieces of a frame of several
sessions, mesh/runtime/batch_graphs.py), and the same sessions run one frame each
(a stage that batched nothing) with graphs.

A Llama-shaped model with random weights (default: TinyLlama-1.1B's shape, 22
layers, bfloat16) is built on the device and loaded as one stage holding every layer,
the embedding and the head. Each of B sessions holds ``--position`` tokens; a step
decodes one token for every session (the step starts at the same position each
time, so every step does the same work); ``--window W`` sends W rows per session
instead (a verify window; "one by one" then runs each window eagerly, as a frame of
one session's several rows runs without batching). Prints milliseconds per step (medians of
the repeats), the speed-up of graphs over eager kernels, what batching gains over
one frame per session, and the largest logit difference between graphs and eager
kernels; writes JSON.

Off CUDA (``--device cpu``, the tests) the graph modes run the same pieces eagerly.

    python benchmarks/graph_bench.py [--device cuda] [--batches 1 2 4 8 16 32]
        [--repeats 5] [--steps 20] [--layers 22] [--hidden 2048] ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import emit, machine_info, render_table, write_json
from transformers import LlamaConfig, LlamaForCausalLM

from mesh.runtime import Span, StageRuntime, StateDictWeights, build_stage_runtime
from mesh.types import LayerRange

MODES = ("eager", "graphs", "one by one")


def build_runtime(args: argparse.Namespace) -> StageRuntime:
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.position * 2),
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype)
    weights = StateDictWeights(model.state_dict(), tied=False)
    runtime = build_stage_runtime(
        config,
        weights,
        LayerRange(0, args.layers),
        device=args.device,
        dtype=args.dtype,
        max_sessions=max(args.batches) + 4,
    )
    del model, weights
    return runtime


def set_mode(runtime: StageRuntime, mode: str, device: str) -> None:
    runtime.disable_graphs()
    if mode == "eager":
        return
    if device.startswith("cuda"):
        if not (runtime.enable_cuda_graphs() and runtime.check_graphs()):
            raise RuntimeError("CUDA graphs could not be turned on (see the log)")
    else:
        runtime.use_static_decode(capture=False)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_fn(
    runtime: StageRuntime, mode: str, batch: int, position: int, window: int
) -> Callable[[], Any]:
    """One step of ``batch`` sessions, ``window`` rows each (a decode token, or a
    verify window), at ``position``."""
    ids = torch.arange(batch * window) % runtime.vocab_size
    if mode == "one by one":

        def alone() -> list[torch.Tensor]:
            return [
                runtime.forward(f"s{i}", position, ids[i * window : (i + 1) * window])
                for i in range(batch)
            ]

        return alone
    spans = [Span(f"s{i}", position, window) for i in range(batch)]

    def together() -> torch.Tensor:
        return runtime.forward_batch(spans, ids).rows  # type: ignore[return-value]

    return together


def time_steps(step: Callable[[], Any], steps: int, device: str) -> float:
    """Milliseconds per step over ``steps`` steps (after two untimed ones)."""
    for _ in range(2):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) * 1000.0 / steps


def logits_of(runtime: StageRuntime, mode: str, batch: int, args: argparse.Namespace) -> Any:
    set_mode(runtime, mode, args.device)
    kind = "eager" if mode == "eager" else "graphs"
    out = step_fn(runtime, kind, batch, args.position, args.window)()
    return out.float().cpu()


def run(args: argparse.Namespace) -> dict[str, Any]:
    runtime = build_runtime(args)
    prompt = torch.arange(args.position) % args.vocab
    for i in range(max(args.batches)):
        runtime.forward(f"s{i}", 0, prompt)
    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in args.batches:
            order = MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]
            for mode in order:
                set_mode(runtime, "graphs" if mode == "one by one" else mode, args.device)
                step = step_fn(runtime, mode, batch, args.position, args.window)
                ms = time_steps(step, args.steps, args.device)
                times.setdefault((mode, batch), []).append(ms)
    rows = []
    for batch in args.batches:
        eager = logits_of(runtime, "eager", batch, args)
        graphed = logits_of(runtime, "graphs", batch, args)
        difference = (graphed - eager).abs().max().item()
        median = {mode: statistics.median(times[(mode, batch)]) for mode in MODES}
        rows.append(
            {
                "batch": batch,
                "ms_per_step": median,
                "graphs_speedup": median["eager"] / median["graphs"],
                "batching_gain": median["one by one"] / median["graphs"],
                "rows_per_second": batch * args.window * 1000.0 / median["graphs"],
                "max_logit_difference": difference,
                "logit_scale": eager.abs().max().item(),
                "repeats_ms": {mode: times[(mode, batch)] for mode in MODES},
            }
        )
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    return {
        "machine": machine_info(torch.get_num_threads()),
        "device": device_name,
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "position": args.position,
        },
        "window": args.window,
        "repeats": args.repeats,
        "steps": args.steps,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    headers = [
        "sessions",
        "eager ms",
        "graphs ms",
        "one by one ms",
        "graphs / eager",
        "batched / one by one",
        "rows/s (graphs)",
        "max logit diff",
    ]
    body = [
        [
            str(row["batch"]),
            f"{row['ms_per_step']['eager']:.2f}",
            f"{row['ms_per_step']['graphs']:.2f}",
            f"{row['ms_per_step']['one by one']:.2f}",
            f"{row['graphs_speedup']:.2f}x",
            f"{row['batching_gain']:.2f}x",
            f"{row['rows_per_second']:.0f}",
            f"{row['max_logit_difference']:.3g}",
        ]
        for row in result["rows"]
    ]
    title = f"device: {result['device']}, model {result['model']}"
    title += f", rows per session {result['window']}"
    return title + "\n" + render_table(headers, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--position", type=int, default=512)
    parser.add_argument(
        "--window", type=int, default=1, help="rows per session: 1 (decode) or a verify window"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("bench-results/graph_bench.json"))
    args = parser.parse_args(argv)
    result = run(args)
    emit(render(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
