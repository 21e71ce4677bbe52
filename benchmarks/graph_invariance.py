"""Does a session's result depend on the frame it runs in, on the graph paths?

One runtime holds every layer of a Llama-shaped model with random weights (SmolLM2-
135M's shape by default, standard deviation 0.05). Eight sessions with prompts of
different lengths decode ``--tokens`` teacher-forced tokens (the same tokens in every
mode, so every position compares) in five modes: each session in its own frame,
eagerly ("alone eager", the reference) and through its one-session graph step ("alone
graphs"); all sessions in one frame, eagerly ("batch eager"), through the bucketed
graph steps with the frame's attention gathered ("batch graphs", what a stage runs
with ``--cuda-graphs``), and through the same steps with attention run per session.
Prints, per mode, the largest logit difference from the reference and the positions
whose argmax (the greedy token) differs; writes JSON.

Off CUDA (``--device cpu``) the graph modes run the same pieces eagerly.

    python benchmarks/graph_invariance.py [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from common import emit, machine_info, render_table, write_json
from graph_bench import set_mode
from transformers import LlamaConfig, LlamaForCausalLM

import mesh.runtime.batch_graphs as batch_graphs
from mesh.runtime import Span, StageRuntime, StateDictWeights, build_stage_runtime
from mesh.types import LayerRange

SESSIONS = 8
# (batched, graphs, the frame's attention gathered)
MODES = {
    "alone eager": (False, False, True),
    "alone graphs": (False, True, True),
    "batch eager": (True, False, True),
    "batch graphs": (True, True, True),
    "batch graphs, attention per session": (True, True, False),
}


def build(args: argparse.Namespace) -> StageRuntime:
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    weights = StateDictWeights(model.state_dict(), tied=True)
    return build_stage_runtime(
        config,
        weights,
        LayerRange(0, args.layers),
        device=args.device,
        dtype=args.dtype,
        max_sessions=SESSIONS * 3,
    )


def decode(
    runtime: StageRuntime,
    args: argparse.Namespace,
    prompts: list[torch.Tensor],
    forced: torch.Tensor,
    mode: tuple[bool, bool, bool],
) -> torch.Tensor:
    """``[sessions, tokens, vocab]`` logits of the forced tokens in ``mode``."""
    batched, graphs, gathered = mode
    set_mode(runtime, "graphs" if graphs else "eager", args.device)
    fits = batch_graphs.FrameAttention.fits
    if not gathered:
        batch_graphs.FrameAttention.fits = classmethod(lambda cls, segments: False)  # type: ignore[method-assign]
    try:
        logits = torch.zeros(SESSIONS, args.tokens, args.vocab)
        for i, prompt in enumerate(prompts):
            runtime.drop_session(f"s{i}")
            runtime.forward(f"s{i}", 0, prompt)
        for t in range(args.tokens):
            if batched:
                spans = [Span(f"s{i}", len(p) + t, 1) for i, p in enumerate(prompts)]
                logits[:, t] = runtime.forward_batch(spans, forced[:, t]).rows.float().cpu()  # type: ignore[union-attr]
                continue
            for i, prompt in enumerate(prompts):
                row = runtime.forward(f"s{i}", len(prompt) + t, forced[i, t : t + 1])
                logits[i, t] = row[-1].float().cpu()
        return logits
    finally:
        batch_graphs.FrameAttention.fits = fits  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    runtime = build(args)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, args.vocab, (40 + 7 * i,), generator=generator) for i in range(SESSIONS)
    ]
    forced = torch.randint(0, args.vocab, (SESSIONS, args.tokens), generator=generator)
    reference = None
    rows = []
    for name, mode in MODES.items():
        started = time.perf_counter()
        logits = decode(runtime, args, prompts, forced, mode)
        seconds = time.perf_counter() - started
        reference = logits if reference is None else reference
        rows.append(
            {
                "mode": name,
                "max_logit_difference": (logits - reference).abs().max().item(),
                "argmax_flips": int((logits.argmax(-1) != reference.argmax(-1)).sum().item()),
                "positions": SESSIONS * args.tokens,
                "logit_scale": reference.abs().max().item(),
                "seconds": seconds,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=12, help="forced tokens per session")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--json", type=Path, default=Path("bench-results/graph_invariance.json"))
    args = parser.parse_args(argv)
    rows = run(args)
    headers = ["mode", "max logit difference", "argmax flips", "seconds"]
    body = [
        [
            r["mode"],
            f"{r['max_logit_difference']:.3g}",
            f"{r['argmax_flips']}/{r['positions']}",
            f"{r['seconds']:.2f}",
        ]
        for r in rows
    ]
    emit(f"graph invariance: {args.device}, {args.dtype}, {args.layers} layers, random weights")
    emit(render_table(headers, body))
    write_json(
        args.json,
        {
            "benchmark": "graph_invariance",
            "machine": machine_info(1),
            "args": vars(args) | {"json": str(args.json)},
            "rows": rows,
        },
    )
    emit(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
