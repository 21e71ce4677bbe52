"""Failover figures: kill -9 the middle stage of a local 3-stage mesh while 4 greedy
streams run, and measure how long the streams pause, how long the coordinator takes
to notice and to serve again, and whether any request or token was lost (each output
is compared with a run without the failure). Prints a table and writes JSON.

    .venv/bin/python benchmarks/failover_bench.py --repeats 3 --out bench-results/failover.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from openai import OpenAI

from coordinator.localmesh import MeshProcesses, wait_for
from mesh.package.default import build_default_package

PROMPTS = [f"Write two sentences about the number {i}." for i in range(4)]


def stream(client: OpenAI, model: str, prompt: str, tokens: int, started: threading.Event):
    """(text, arrival times of the chunks)."""
    text, times = [], []
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
    )
    for chunk in reply:
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
                times.append(time.monotonic())
        if len(times) >= 3:
            started.set()
    return "".join(text), times


def one_run(package: Path, tokens: int) -> dict:
    mesh = MeshProcesses(package, Path(tempfile.mkdtemp(prefix="mesh-failover-")), 3)
    try:
        mesh.start().wait_serving(deadline_s=600)
        model = mesh.status().model_id
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="x", max_retries=0, timeout=600)
        never = threading.Event()
        baseline = [stream(client, model, p, tokens, never)[0] for p in PROMPTS]
        started = [threading.Event() for _ in PROMPTS]
        middle = next(s for s in mesh.status().stages if s.assigned and s.stage_index == 1)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [
                pool.submit(stream, client, model, p, tokens, started[i])
                for i, p in enumerate(PROMPTS)
            ]
            for event in started:
                event.wait(300)
            killed = time.monotonic()
            mesh.kill_stage(middle.node_id)
            wait_for(
                lambda: any(
                    s.node_id == middle.node_id and s.health == "dead" for s in mesh.status().stages
                ),
                60,
                "the coordinator to notice",
            )
            noticed = time.monotonic()
            results = [f.result(timeout=600) for f in futures]
        serving = mesh.status()
    finally:
        mesh.close()
    pauses = []
    for _, times in results:
        after = [t for t in times if t > killed]
        before = [t for t in times if t <= killed]
        if after and before:
            pauses.append(after[0] - before[-1])
    return {
        "detect_s": noticed - killed,
        "max_stream_pause_s": max(pauses) if pauses else 0.0,
        "requests": len(PROMPTS),
        "requests_lost": sum(
            1 for (text, _), base in zip(results, baseline, strict=True) if text != base
        ),
        "term_after": serving.term,
        "stages_after": sum(1 for s in serving.stages if s.assigned),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--package", type=Path, default=None, help="default: SmolLM2")
    parser.add_argument("--out", type=Path, default=Path("bench-results/failover.json"))
    args = parser.parse_args(argv)
    package = args.package or build_default_package()
    runs = [one_run(package, args.tokens) for _ in range(args.repeats)]
    summary = {
        key: statistics.median(r[key] for r in runs) for key in ("detect_s", "max_stream_pause_s")
    }
    summary["requests_lost_total"] = sum(r["requests_lost"] for r in runs)
    summary["requests_total"] = sum(r["requests"] for r in runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "median": summary}, indent=2) + "\n")
    lines = [f"{'run':<5}{'detect s':>10}{'max pause s':>13}{'lost':>6}{'stages after':>14}"]
    for i, r in enumerate(runs):
        lines.append(
            f"{i:<5}{r['detect_s']:>10.2f}{r['max_stream_pause_s']:>13.2f}"
            f"{r['requests_lost']:>6}{r['stages_after']:>14}"
        )
    lines.append(
        f"median detect {summary['detect_s']:.2f}s, median longest pause "
        f"{summary['max_stream_pause_s']:.2f}s, lost {summary['requests_lost_total']}"
        f"/{summary['requests_total']} requests"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
