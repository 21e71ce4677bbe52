"""Per-stage step times of a 3-stage mesh: the even split against the split the
coordinator balances from measured compute, in the same run.

Starts two local meshes of the same package (real coordinator and stage processes on
127.0.0.1). Every stage states the same memory, so the first plan of both is the
even split (stated memory is a share); the *even* mesh keeps it (rebalancing off),
the *balanced* mesh plans again once its stages have measured their step times
(``--rebalance-spread`` 15%): warm-up rounds run on it until a round is followed by
no rebalance (or the wait ends). Then
``--repeats`` rounds alternate between the meshes (one mesh under load at a time):
``--streams`` concurrent greedy chat completions, after which each stage's measured
step time (the mean compute time of its last 64 frames, from the coordinator's
``status``) and the throughput are read.

Reported per mesh: the layer split, the planned and measured step time per stage,
the spread (slowest over fastest stage, less 1), tokens per second, and the load
average seen (the machine may be shared: read the figures with it).

    .venv/bin/python benchmarks/balance_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    add_common_arguments,
    command_line,
    configure,
    emit,
    fmt,
    load_average,
    machine_info,
    median,
    openai_client,
    render_table,
    resolve_package,
    write_json,
)

from coordinator.localmesh import MeshProcesses, wait_for

logger = logging.getLogger("balance_bench")

PROMPTS = [
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how a hash map works, with an example in Python.",
    "List ten animals and one fact about each.",
    "Describe the water cycle for a school textbook.",
]
HEARTBEAT_SETTLE_S = 2.5
# A plan counts as settled when no rebalance follows a round within this long (the
# coordinator checks every 10 s at most).
STABLE_WAIT_S = 15.0


def start_mesh(package: Path, workdir: Path, args: argparse.Namespace, rebalance: float):
    coordinator = ("--heartbeat-timeout", str(args.heartbeat_timeout))
    mesh = MeshProcesses(
        package,
        workdir,
        3,
        threads=args.threads,
        max_sessions=max(4, args.streams),
        max_queued=max(4, args.streams),
        stage0_args=("--spec-type", "none"),
        stage_args=("--memory", args.memory),
        coordinator_args=(*coordinator, "--rebalance-spread", str(rebalance)),
    )
    return mesh.start()


def run_round(mesh: MeshProcesses, model_id: str, streams: int, max_tokens: int) -> dict:
    """``streams`` concurrent completions; tokens and wall time."""
    tokens = [0] * streams
    errors: list[str] = []

    def one(index: int) -> None:
        try:
            reply = openai_client(mesh.http_url).chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
                max_tokens=max_tokens,
                temperature=0,
            )
            tokens[index] = reply.usage.completion_tokens
        except Exception as error:  # noqa: BLE001 - reported with the round
            errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    return {"tokens": sum(tokens), "wall_s": wall_s, "errors": errors}


def stage_figures(mesh: MeshProcesses) -> dict[str, Any]:
    status = mesh.status()
    stages = sorted((s for s in status.stages if s.assigned), key=lambda s: s.stage_index)
    measured = [s.measured_step_ms for s in stages]
    return {
        "term": status.term,
        "layers": [[s.layer_range.start, s.layer_range.end] for s in stages],
        "planned_step_ms": [s.planned_step_ms for s in stages],
        "measured_step_ms": measured,
        "layer_ms": [s.layer_ms for s in stages],
        "head_ms": [s.head_ms for s in stages],
        "spread": max(measured) / min(measured) - 1.0 if all(m > 0 for m in measured) else None,
    }


def measure_round(mesh: MeshProcesses, model_id: str, args: argparse.Namespace) -> dict:
    """One round and the stages' figures after it; a round that a reload interrupted
    (errors, or the term moved on) is run again, up to 3 times (noted)."""
    interrupted = []
    for _ in range(3):
        term = mesh.status().term
        result = run_round(mesh, model_id, args.streams, args.max_tokens)
        time.sleep(HEARTBEAT_SETTLE_S)  # the stages' next heartbeats carry the round's frames
        result.update(stage_figures(mesh))
        if not result["errors"] and result["term"] == term:
            break
        interrupted.append(f"term {term} -> {result['term']}: {len(result['errors'])} errors")
        mesh.wait_serving(term=result["term"])
    result["interrupted"] = interrupted
    result["tokens_per_s"] = result["tokens"] / result["wall_s"] if result["wall_s"] else None
    result["load_average"] = load_average()
    return result


def settle_balanced(mesh: MeshProcesses, model_id: str, args: argparse.Namespace) -> dict:
    """At least ``--warmups`` warm-up rounds, then until a round leaves the plan as it
    is (no new term within ``STABLE_WAIT_S`` of it while the mesh is idle), or the
    wait ends: the first plan, the rounds, and the terms the rebalances loaded."""
    first = stage_figures(mesh)
    deadline = time.monotonic() + args.rebalance_wait
    warmups: list[dict] = []
    terms = [first["term"]]
    while time.monotonic() < deadline:
        warmups.append(measure_round(mesh, model_id, args))
        term = warmups[-1]["term"]
        if len(warmups) < args.warmups:
            continue
        try:
            wait_for(lambda t=term: mesh.status().term > t, STABLE_WAIT_S, "a rebalance")
        except TimeoutError:
            break
        terms.append(mesh.status().term)
        mesh.wait_serving(term=terms[-1])
    return {"first_plan": first, "warmups": warmups, "terms": terms}


def summarize(label: str, rounds: list[dict]) -> dict[str, Any]:
    stages = len(rounds[-1]["measured_step_ms"])
    return {
        "mesh": label,
        "layers": rounds[-1]["layers"],
        "terms": sorted({r["term"] for r in rounds}),
        "planned_step_ms": rounds[-1]["planned_step_ms"],
        "measured_step_ms": [
            median([r["measured_step_ms"][i] for r in rounds]) for i in range(stages)
        ],
        "spread": median(
            [r["spread"] for r in rounds if r["spread"] is not None] or [float("nan")]
        ),
        "tokens_per_s": median([r["tokens_per_s"] for r in rounds if r["tokens_per_s"]]),
        "errors": sum(len(r["errors"]) for r in rounds),
        "interrupted_rounds": sum(len(r["interrupted"]) for r in rounds),
    }


def render(summaries: list[dict[str, Any]]) -> str:
    headers = ["mesh", "layers", "planned ms", "measured ms", "spread", "tok/s", "terms"]
    rows = []
    for s in summaries:
        rows.append(
            [
                s["mesh"],
                " ".join(f"[{a},{b})" for a, b in s["layers"]),
                " / ".join(fmt(v, 1) for v in s["planned_step_ms"]),
                " / ".join(fmt(v, 1) for v in s["measured_step_ms"]),
                f"{100 * s['spread']:.0f}%" if s["spread"] == s["spread"] else "-",
                fmt(s["tokens_per_s"], 1),
                ",".join(str(t) for t in s["terms"]),
            ]
        )
    return render_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "balance_bench")
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--warmups",
        type=int,
        default=3,
        help="warm-up rounds on the balanced mesh before it counts as settled (its "
        "stages need 64 frames each before the coordinator compares them)",
    )
    parser.add_argument("--memory", default="8GiB", help="memory every stage states")
    parser.add_argument(
        "--rebalance-wait",
        type=float,
        default=240.0,
        help="seconds of warm-up rounds on the balanced mesh before measuring anyway",
    )
    args = parser.parse_args(argv)
    configure(args)
    package = resolve_package(args.package)
    info = machine_info(args.threads)
    with tempfile.TemporaryDirectory(prefix="balance-bench-") as tmp:
        root = args.workdir or Path(tmp)
        meshes = {
            "even": start_mesh(package, root / "even", args, rebalance=0.0),
            "balanced": start_mesh(package, root / "balanced", args, rebalance=0.15),
        }
        try:
            model_id = ""
            for mesh in meshes.values():
                model_id = mesh.wait_serving()["model_id"]
            settled = settle_balanced(meshes["balanced"], model_id, args)
            measure_round(meshes["even"], model_id, args)  # warm-up
            rounds: dict[str, list[dict]] = {name: [] for name in meshes}
            for repeat in range(args.repeats):
                order = list(meshes) if repeat % 2 == 0 else list(reversed(meshes))
                for name in order:
                    rounds[name].append(measure_round(meshes[name], model_id, args))
                    logger.info("repeat %s %s: %s", repeat, name, rounds[name][-1])
        finally:
            for mesh in meshes.values():
                mesh.close()
    summaries = [summarize(name, rounds[name]) for name in meshes]
    emit(render(summaries))
    emit(
        f"balanced mesh: first plan {settled['first_plan']['layers']}, terms loaded while "
        f"settling {settled['terms']}; load average at start "
        f"{info['load_average_at_start']}, at end {load_average()}"
    )
    write_json(
        args.out,
        {
            "command": command_line(),
            "machine": info,
            "load_average_at_end": load_average(),
            "settings": {
                "streams": args.streams,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "memory": args.memory,
            },
            "balanced_settling": settled,
            "summaries": summaries,
            "rounds": rounds,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
