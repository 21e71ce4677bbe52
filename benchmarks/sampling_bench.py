"""The cost of choosing a token on a stage: greedy, temperature, top-p, top-k and
min-p over vocabularies of 32,000 to 151,936 tokens, against the plain way of
computing the same choice in the same run (``torch.argmax``, and top-p by sorting
the whole vocabulary with torch).

The last stage chooses every token of every request; where a decode step takes a few
milliseconds (a small model, or any model on a GPU, where the logits come to the
CPU to be sampled) the choice is a real part of it. Logits are synthetic, of three
shapes: ``peaked`` (normal logits times 8: most mass on a few tokens, as an
instruction-tuned model's next token usually is), ``zipf`` (probability of the
k-th token proportional to 1/k^1.1: a heavy tail) and ``flat`` (normal logits:
mass spread over most of the vocabulary). Prints microseconds per choice (medians
of the repeats) and the speed-up; writes JSON.

    python benchmarks/sampling_bench.py [--vocab 32000 49152 151936] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import emit, machine_info, render_table, write_json

from mesh.sampling import draw_token, first_maxima, sample_token
from mesh.types import SamplingParams

CHOICES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8, "seed": 1},
    "top_p 0.9": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
    "top_p 0.95": {"temperature": 1.0, "top_p": 0.95, "seed": 1},
    "top_k 40": {"temperature": 0.7, "top_k": 40, "seed": 1},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05, "seed": 1},
}


def logits_of(shape: str, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(vocab)
    if shape == "peaked":
        return torch.randn(vocab, generator=generator) * 8
    if shape == "flat":
        return torch.randn(vocab, generator=generator)
    ranks = torch.randperm(vocab, generator=generator).to(torch.float32) + 1
    return -1.1 * torch.log(ranks)


def plain_choice(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The same choice computed the plain way (the baseline): ``torch.argmax``, and
    top-p by sorting the whole vocabulary."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        values, order = torch.sort(probs, descending=True)
        before = torch.cumsum(values, dim=-1) - values
        values = values.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, values)
        probs = probs / probs.sum()
    return draw_token(probs, params.seed, position)  # the draw itself is shared


def per_call_us(call: Callable[[int], Any], calls: int) -> float:
    for position in range(3):
        call(position)
    started = time.perf_counter()
    for position in range(calls):
        call(position)
    return (time.perf_counter() - started) / calls * 1e6


def argmax_rows(rows: torch.Tensor, _position: int) -> list[int]:
    return torch.argmax(rows, dim=-1).tolist()


def first_maxima_of(rows: torch.Tensor, _position: int) -> list[int]:
    return first_maxima(rows)


def alternated(
    calls: dict[str, Callable[[int], Any]], repeats: int, per_repeat: int
) -> dict[str, list[float]]:
    """Microseconds per call of each of ``calls``, ``repeats`` times, alternating
    which runs first."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            times[name].append(per_call_us(calls[name], per_repeat))
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in args.vocab:
        for shape in ("peaked", "zipf", "flat"):
            logits = logits_of(shape, vocab)
            for name, fields in CHOICES.items():
                params = SamplingParams(**fields)
                agree = all(
                    sample_token(logits, params, p) == plain_choice(logits, params, p)
                    for p in range(args.calls)
                )
                calls = {
                    "plain": partial(plain_choice, logits, params),
                    "this": partial(sample_token, logits, params),
                }
                times = alternated(calls, args.repeats, args.calls)
                plain = statistics.median(times["plain"])
                this = statistics.median(times["this"])
                rows.append(
                    {
                        "vocab": vocab,
                        "logits": shape,
                        "choice": name,
                        "plain_us": plain,
                        "this_us": this,
                        "speedup": plain / this,
                        "same_tokens": agree,
                        "repeats_us": times,
                    }
                )
        # A verify window's greedy rows at once.
        for count in (1, 8):
            window = torch.randn(count, vocab, generator=torch.Generator().manual_seed(count))
            calls = {
                "plain": partial(argmax_rows, window),
                "this": partial(first_maxima_of, window),
            }
            times = alternated(calls, args.repeats, args.calls)
            plain, this = statistics.median(times["plain"]), statistics.median(times["this"])
            rows.append(
                {
                    "vocab": vocab,
                    "logits": f"{count} rows",
                    "choice": "greedy rows (verify)",
                    "plain_us": plain,
                    "this_us": this,
                    "speedup": plain / this,
                    "same_tokens": first_maxima(window) == torch.argmax(window, -1).tolist(),
                    "repeats_us": times,
                }
            )
    return {"benchmark": "sampling_bench", "machine": machine_info(args.threads), "rows": rows}


def render(result: dict[str, Any]) -> str:
    headers = ["vocab", "logits", "choice", "plain us", "this us", "speed-up", "same tokens"]
    body = [
        [
            str(row["vocab"]),
            row["logits"],
            row["choice"],
            f"{row['plain_us']:.0f}",
            f"{row['this_us']:.0f}",
            f"{row['speedup']:.2f}x",
            "yes" if row["same_tokens"] else "NO",
        ]
        for row in result["rows"]
    ]
    return render_table(headers, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 151936])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="choices timed per repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=Path("bench-results/sampling_bench.json"))
    args = parser.parse_args(argv)
    result = run(args)
    emit(render(result))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
