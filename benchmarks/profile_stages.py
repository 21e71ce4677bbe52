"""Where a stage process's time goes while it serves: py-spy samples every stage of a
local mesh under a steady load of streaming requests, and the samples are folded
into a table of the functions that hold the most time (own time and with callees),
per process and per thread.

    .venv/bin/python benchmarks/profile_stages.py --streams 8 --seconds 15

Needs ``py-spy`` (``pip install py-spy``) and the right to trace the stage
processes (root, or ptrace permitted).
"""

from __future__ import annotations

import argparse
import collections
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import emit, openai_client, render_table, resolve_package, write_json

from coordinator.localmesh import MeshProcesses

logger = logging.getLogger("profile_stages")

PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain how a hash map works, step by step, with an example in Python.",
    "List twenty animals and one fact about each.",
    "Describe the water cycle in detail for a school textbook.",
]


def load(url: str, model_id: str, streams: int, stop: threading.Event) -> list[int]:
    """``streams`` client threads streaming completions until ``stop``; tokens each."""
    counts = [0] * streams

    def worker(index: int) -> None:
        try:
            stream_until(index)
        except Exception:  # noqa: BLE001 - the mesh stops under the streams at the end
            if not stop.is_set():
                raise

    def stream_until(index: int) -> None:
        client = openai_client(url)
        while not stop.is_set():
            stream = client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
                max_tokens=256,
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                counts[index] += sum(1 for c in chunk.choices if c.delta.content)
                if stop.is_set():
                    stream.close()
                    break

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    return counts


def record(pid: int, seconds: float, out: Path, native: bool) -> subprocess.Popen:
    command = [
        shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        "200",
        "--format",
        "raw",
        "--threads",
        "--output",
        str(out),
        "--nonblocking",
    ]
    if native:
        command.append("--native")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def fold(path: Path, top: int) -> dict[str, Any]:
    """Own and inclusive samples per function, and samples per thread."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] += count
        functions = [_short(f) for f in frames[1:]]
        if functions:
            own[functions[-1]] += count
        for name in set(functions):
            inclusive[name] += count
    return {
        "samples": total,
        "threads": threads.most_common(),
        "own": own.most_common(top),
        "inclusive": inclusive.most_common(top),
    }


def _short(frame: str) -> str:
    """``function (path/to/file.py:12)`` as ``function (file.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rsplit("/", 1)[-1].split(":")[0]
    return f"{name} ({file}" + (")" if file else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--native", action="store_true", help="py-spy --native")
    parser.add_argument(
        "--spec-type", default=None, help="stage 0's --spec-type (default: the package's)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/profile-stages.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    package = resolve_package(args.package)
    workdir = Path(tempfile.mkdtemp(prefix="mesh-profile-"))
    stage0_args = ("--spec-type", args.spec_type) if args.spec_type else ()
    mesh = MeshProcesses(
        package, workdir, args.stages, threads=args.threads, stage0_args=stage0_args
    )
    stop = threading.Event()
    try:
        mesh.start().wait_serving(deadline_s=300)
        status = mesh.status()
        model_id = status.model_id
        counts = load(mesh.http_url, model_id, args.streams, stop)
        time.sleep(args.warmup)
        before = sum(counts)
        recorders = {}
        for node_id, process in mesh.stages.items():
            out = workdir / f"{node_id}.txt"
            recorders[node_id] = (record(process.pid, args.seconds, out, args.native), out)
        started = time.monotonic()
        for recorder, _ in recorders.values():
            recorder.wait(args.seconds + 60)
        tokens = sum(counts) - before
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        mesh.close()
    report: dict[str, Any] = {
        "streams": args.streams,
        "tokens_per_s": tokens / elapsed,
        "processes": {},
    }
    emit(f"{args.streams} streams: {tokens / elapsed:.1f} tok/s while sampling")
    for node_id, (_, out) in sorted(recorders.items()):
        folded = fold(out, args.top)
        report["processes"][node_id] = folded
        total = max(1, folded["samples"])
        emit(f"\n{node_id}: {folded['samples']} samples")
        emit(
            render_table(
                ["thread", "share"],
                [[name[:70], f"{100 * n / total:.1f}%"] for name, n in folded["threads"]],
            )
        )
        rows = [[name[:90], f"{100 * n / total:.1f}%"] for name, n in folded["inclusive"]]
        emit(render_table(["function (with callees)", "share"], rows))
        rows = [[name[:90], f"{100 * n / total:.1f}%"] for name, n in folded["own"]]
        emit(render_table(["function (own time)", "share"], rows))
    write_json(args.out, report)
    emit(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
