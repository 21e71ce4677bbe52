"""Soak: mixed concurrent traffic against a local 2-stage mesh for a fixed time, then
check that no session leaked on any stage and report each process's RSS at the start
(after a warm-up) and at the end. Prints a table and writes JSON.

    .venv/bin/python benchmarks/soak.py --duration 600 --out bench-results/soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from coordinator.localmesh import MeshProcesses, wait_for
from mesh.package.default import build_default_package

PROMPTS = [
    "Rename the variable x to count in: def f(x): return x + x",
    "What is the capital of Italy?",
    "Write a haiku about rivers.",
    'Return this JSON unchanged: {"a": 1, "b": [1, 2, 3]}',
]


def one_request(url: str, model: str, rng: random.Random) -> str:
    """One request of a random kind; returns its outcome label."""
    kind = rng.choice(["chat", "chat-stream", "completion", "stop", "disconnect", "bad", "seeded"])
    prompt = rng.choice(PROMPTS)
    body: dict = {"model": model, "max_tokens": rng.randint(1, 24)}
    if kind == "bad":
        body = {"model": model, "messages": [], "temperature": -3}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        return f"bad:{response.status_code}"
    if kind.startswith("chat") or kind in ("stop", "seeded"):
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if kind == "stop":
        body["stop"] = [" the", "\n"]
    if kind == "seeded":
        body.update(temperature=0.8, seed=rng.randint(0, 1000))
    if kind in ("chat-stream", "disconnect"):
        body["stream"] = True
        with httpx.stream("POST", url + path, json=body, timeout=120) as response:
            for index, _line in enumerate(response.iter_lines()):
                if kind == "disconnect" and index >= 2:
                    break
            return f"{kind}:{response.status_code}"
    response = httpx.post(url + path, json=body, timeout=120)
    return f"{kind}:{response.status_code}"


def rss(processes: dict[str, int]) -> dict[str, int]:
    return {name: psutil.Process(pid).memory_info().rss for name, pid in processes.items()}


def held(mesh: MeshProcesses) -> dict[str, int]:
    """Bytes of KV cache each stage holds for kept prefixes (the prefix cache, bounded
    by stage 0's ``--prefix-cache-tokens``): RSS grows with it until it is full."""
    return {s.node_id: s.prefix_bytes for s in mesh.status().stages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the RSS start")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--package", type=Path, default=None, help="default: SmolLM2")
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args(argv)
    package = args.package or build_default_package()
    workdir = Path(tempfile.mkdtemp(prefix="mesh-soak-"))
    mesh = MeshProcesses(package, workdir, 2, max_sessions=8)
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = [0.0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at[0]:
            try:
                label = one_request(mesh.http_url, status.model_id, rng)
            except httpx.HTTPError as error:
                label = f"client-error:{type(error).__name__}"
            with lock:
                outcomes[label] = outcomes.get(label, 0) + 1

    try:
        mesh.start().wait_serving(deadline_s=600)
        status = mesh.status()
        pids = {"coordinator": mesh.coordinator.pid}
        pids.update({node: proc.pid for node, proc in mesh.stages.items()})
        started = time.monotonic()
        stop_at[0] = started + args.warmup + args.duration
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup)
        rss_start = rss(pids)
        prefix_start = held(mesh)
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started - args.warmup
        wait_for(
            lambda: all(s.active_sessions == 0 for s in mesh.status().stages),
            30,
            "sessions to drain",
        )
        rss_end = rss(pids)
        prefix_end = held(mesh)
        leaked = {s.node_id: s.active_sessions for s in mesh.status().stages}
    finally:
        mesh.close()
    server_errors = sum(n for label, n in outcomes.items() if label.endswith(":500"))
    result = {
        "duration_s": round(elapsed, 1),
        "workers": args.workers,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "server_errors": server_errors,
        "sessions_after": leaked,
        "rss_start_bytes": rss_start,
        "rss_end_bytes": rss_end,
        "prefix_kv_start_bytes": prefix_start,
        "prefix_kv_end_bytes": prefix_end,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"soak: {result['requests']} requests in {elapsed:.0f}s, {server_errors} HTTP 500s"]
    lines.append(
        f"{'process':<14}{'RSS start MiB':>15}{'RSS end MiB':>13}{'growth':>9}"
        f"{'kept prefixes MiB':>19}{'growth besides them MiB':>25}"
    )
    for name in pids:
        a, b = rss_start[name] / 2**20, rss_end[name] / 2**20
        p0, p1 = prefix_start.get(name, 0) / 2**20, prefix_end.get(name, 0) / 2**20
        kept = f"{p0:.1f} -> {p1:.1f}" if name in prefix_end else "-"
        lines.append(
            f"{name:<14}{a:>15.1f}{b:>13.1f}{(b - a) / a * 100:>8.1f}%"
            f"{kept:>19}{(b - a) - (p1 - p0):>25.1f}"
        )
    lines.append(f"sessions left per stage: {leaked}")
    lines.append("outcomes: " + ", ".join(f"{k}={v}" for k, v in result["outcomes"].items()))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if server_errors == 0 and not any(leaked.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
