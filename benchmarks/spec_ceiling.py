"""The speculation ceiling a model's own answers set: the drafters and the window
policy replayed over the target's greedy outputs, with no mesh.

Greedy speculation keeps exactly the target's tokens, so the target's greedy answer
to each request is known in advance: this script generates it once (the package
through one stage runtime, as the mesh computes it; or ``--model``, a GGUF file or
Hugging Face directory through transformers), then replays each drafter
configuration over it, round by round, as stage 0's engine core would run a
single request: the policy picks the window, the drafter proposes, the drafts are
accepted while they equal the answer's next tokens, and the answer's token after
them is committed. A round costs ``step + 2 * latency + per_token * drafts``
(``--step-ms``: one single-row step of the whole pipeline; ``--per-token-ratio``:
what one more row of a verify window adds, as a fraction of the step; two hops per
round on a 2-stage mesh). The speedup is plain decoding's time (one round per
token, no drafts) over the replay's. Nothing else is counted (the drafter's own
time, the frontend, prefill), so a measured end-to-end speedup is lower: this is
what the answers allow, whatever the mesh does. ``tokens/round`` with free
verification is the bound at any speed.

    .venv/bin/python benchmarks/spec_ceiling.py --latency-ms 0 20 \\
        --out bench-results/spec_ceiling.json
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common import (
    WorkloadRequest,
    command_line,
    default_workloads_path,
    emit,
    fmt,
    load_average,
    load_workloads,
    machine_info,
    render_table,
    write_json,
)
from spec_bench import prediction_of

from mesh.config import SpeculationConfig, WindowPolicySpec
from mesh.speculative.factory import build_drafter
from mesh.speculative.policy import RoundContext, make_policy, plan_window
from mesh.speculative.prediction import PredictionDrafter
from stage.frontend.scheduler import PREDICTION_MAX_WINDOW

logger = logging.getLogger("spec_ceiling")


@dataclass(frozen=True)
class Answer:
    """A request's prompt tokens, the target's greedy answer and, for a request with
    a code block, that code's tokens (what a client would send as ``prediction``)."""

    workload: str
    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    prediction: tuple[int, ...] | None


@dataclass(frozen=True)
class Replay:
    tokens: int
    rounds: int
    drafted: int
    accepted: int
    time_s: float


def package_generator(package: Path) -> tuple[Any, Any]:
    """(tokenizer, greedy(prompt, limit) -> tokens) of a package, through one stage
    runtime holding the whole model: the served model's own greedy answers (the
    quantised kernels are row-invariant, so a verify window keeps these tokens)."""
    import torch
    from single_stage import package_eos_ids, runtime_greedy
    from transformers import AutoTokenizer

    from mesh.runtime import load_config, load_stage_runtime
    from mesh.types import LayerRange

    torch.set_num_threads(1)
    layers = LayerRange(0, load_config(package).num_hidden_layers)
    runtime = load_stage_runtime(package, layers, device="cpu")
    stop = package_eos_ids(package)

    def greedy(prompt: Sequence[int], limit: int) -> list[int]:
        return runtime_greedy(runtime, prompt, limit, stop=stop).tokens

    return AutoTokenizer.from_pretrained(package), greedy


def transformers_generator(model_path: Path) -> tuple[Any, Any]:
    """(tokenizer, greedy) of a GGUF file or Hugging Face directory (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    gguf = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    folder = model_path.parent if gguf else model_path
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf)

    def greedy(prompt: Sequence[int], limit: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([list(prompt)]), max_new_tokens=limit, do_sample=False, top_p=None
            )
        return out[0, len(prompt) :].tolist()

    return tokenizer, greedy


def generate_answers(
    requests: Sequence[WorkloadRequest], generator: tuple[Any, Any], max_tokens: int | None
) -> list[Answer]:
    tokenizer, greedy = generator
    answers = []
    for request in requests:
        prompt = tokenizer.apply_chat_template(
            list(request.messages), add_generation_prompt=True, return_dict=True
        )["input_ids"]
        limit = min(request.max_tokens, max_tokens or request.max_tokens)
        output = tuple(int(t) for t in greedy(prompt, limit))
        code = prediction_of(request)
        prediction = (
            tuple(tokenizer.encode(code, add_special_tokens=False)) if code is not None else None
        )
        answers.append(
            Answer(request.workload, request.request_id, tuple(prompt), output, prediction)
        )
        logger.info("%s: %d prompt, %d generated", request.request_id, len(prompt), len(output))
    return answers


def replay(answer: Answer, config: str, round_s: tuple[float, float], corpus_tokens: int) -> Replay:
    """One request replayed under ``config`` (``default``, ``ngram`` or
    ``prediction``) with rounds of ``base + per_token * drafts`` seconds."""
    speculation = SpeculationConfig(
        type="ngram" if config == "ngram" else "suffix", corpus_tokens=corpus_tokens
    )
    factory = build_drafter(speculation, None)
    assert factory is not None
    drafter = factory.new_drafter(scope="")
    spec: WindowPolicySpec = speculation.window_policy
    if config == "prediction" and answer.prediction is not None:
        drafter = PredictionDrafter(answer.prediction, drafter)
        spec = replace(spec, max_window=max(spec.max_window, PREDICTION_MAX_WINDOW))
    policy = make_policy(spec)
    base_s, per_token_s = round_s
    out = answer.output
    drafter.begin(answer.prompt)
    drafter.accept(0, out[0])  # the prefill's token
    position, time_s, rounds, drafted, accepted = 1, 0.0, 0, 0, 0
    while position < len(out):
        left = len(out) - position
        window = plan_window(policy, RoundContext(tokens_left=left, draft_cost_per_token_s=0.0))
        proposal = drafter.propose(window) if window > 0 else []
        kept = 0
        while kept < len(proposal) and kept < left - 1 and proposal[kept] == out[position + kept]:
            kept += 1
        cost = base_s + per_token_s * len(proposal)
        time_s, rounds = time_s + cost, rounds + 1
        drafted, accepted = drafted + len(proposal), accepted + kept
        if proposal:
            drafter.accept(kept, out[position + kept])
        else:
            drafter.extend([out[position]])
        policy.observe(len(proposal), kept, cost, 0.0)
        position += kept + 1
    drafter.finish()
    return Replay(len(out) - 1, rounds, drafted, accepted, time_s)


def summarise(replays: Sequence[Replay], base_s: float) -> dict[str, float]:
    tokens = sum(r.tokens for r in replays)
    rounds = sum(r.rounds for r in replays)
    drafted = sum(r.drafted for r in replays)
    return {
        "tokens": tokens,
        "speedup": tokens * base_s / max(sum(r.time_s for r in replays), 1e-12),
        "tokens_per_round": tokens / max(rounds, 1),
        "acceptance": sum(r.accepted for r in replays) / drafted if drafted else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--package",
        type=Path,
        default=None,
        help="model package whose answers to replay (default: the int4 SmolLM2 package "
        "under $MESH_HOME, built on first use)",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a GGUF file or HF directory instead (float32)"
    )
    parser.add_argument("--workloads", type=Path, default=None)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument(
        "--step-ms",
        type=float,
        default=11.9,
        help="one single-row step of the whole pipeline (default: the 2-stage int4 "
        "SmolLM2 mesh's plain decoding, 84 tok/s, docs/benchmarks.md)",
    )
    parser.add_argument(
        "--per-token-ratio",
        type=float,
        default=0.081,
        help="one more verify row, as a fraction of the step (default: a 16-row window "
        "at 2.3x a one-row step on the stage's int4 kernels)",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every answer")
    parser.add_argument("--configs", nargs="+", default=["default", "ngram", "prediction"])
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "spec_ceiling.json")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    unknown = set(args.configs) - {"default", "ngram", "prediction"}
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}: use default, ngram, prediction")
    if args.model is not None:
        model = args.model
        generator = transformers_generator(model)
    else:
        from mesh.package.default import build_default_package

        model = args.package or build_default_package(quant="int4")
        generator = package_generator(model)
    workloads = load_workloads(args.workloads or default_workloads_path())
    requests = [r for group in workloads.values() for r in group]
    started = time.perf_counter()
    answers = generate_answers(requests, generator, args.max_tokens)
    generation_s = time.perf_counter() - started
    rows, results = [], []
    for latency_ms in args.latency_ms:
        base_s = (args.step_ms + 2 * latency_ms) / 1000
        round_s = (base_s, args.per_token_ratio * args.step_ms / 1000)
        for workload in workloads:
            mine = [a for a in answers if a.workload == workload]
            for config in args.configs:
                if config == "prediction" and not any(a.prediction for a in mine):
                    continue
                # Each request alone: its own corpus, nothing learnt from the others.
                replays = [replay(a, config, round_s, 0) for a in mine]
                summary = summarise(replays, base_s)
                results.append({"latency_ms": latency_ms, "workload": workload,
                                "config": config, **summary})  # fmt: skip
                rows.append([
                    fmt(latency_ms, 0), workload, config, fmt(summary["speedup"]),
                    fmt(summary["tokens_per_round"]), fmt(summary["acceptance"]),
                    str(summary["tokens"]),
                ])  # fmt: skip
    emit(
        render_table(
            ["latency ms", "workload", "config", "speedup", "tokens/round", "accept", "tokens"],
            rows,
        )
    )
    payload: dict[str, Any] = {
        "benchmark": "spec_ceiling",
        "command": command_line(),
        "machine": machine_info(1),
        "load_average": load_average(),
        "model": str(model),
        "step_ms": args.step_ms,
        "per_token_ratio": args.per_token_ratio,
        "generation_s": generation_s,
        "answers": [
            {
                "workload": a.workload,
                "id": a.request_id,
                "prompt_tokens": len(a.prompt),
                "output_tokens": len(a.output),
            }
            for a in answers
        ],  # fmt: skip
        "results": results,
    }
    write_json(args.out, payload)
    emit(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
