"""Randomized faults during concurrent streams on a real local mesh, judged stream by
stream against the no-fault output (see coordinator/chaos.py for the rounds).

Starts a mesh of ``--stages`` stage processes and a coordinator on 127.0.0.1, takes
every request's no-fault output (the shared workloads, greedy, plus the same
requests with seeded sampling, plus varied prompts of its own, plus chat requests
with ``n``, log-probabilities, a forced tool call, a JSON schema, predictions and
stop strings, plus embeddings
requests of several long texts, judged within 1e-4), then runs
``--faults`` rounds: each starts ``--streams`` concurrent streams, injects one random
fault (kill, stop for 1-15 s, throttle, coordinator kill and restart) into a
non-zero stage or the coordinator, classifies every stream (identical / failed with
an error / corrupted) and restores the mesh to full size. Prints the table and
writes JSON (every round, every error, any corrupted text in full).

    .venv/bin/python benchmarks/chaos.py --faults 100
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO_ROOT,
    command_line,
    default_workloads_path,
    emit,
    load_workloads,
    machine_info,
    resolve_package,
    write_json,
)

sys.path.insert(0, str(REPO_ROOT))

from coordinator.chaos import (  # noqa: E402 - after the path set-up
    FAULT_KINDS,
    LOOPBACK_FAULT_KINDS,
    NETNS_FAULT_KINDS,
    ChaosRun,
    StreamSpec,
    default_specs,
    embedding_specs,
    feature_specs,
    render_table,
    summarize,
)
from coordinator.localmesh import MeshProcesses  # noqa: E402
from coordinator.netns_hosts import NetnsHosts, unavailable_reason  # noqa: E402


def workload_specs(path: Path, max_tokens: int, rng: random.Random) -> list[StreamSpec]:
    """Every workload request, greedy and again with a seeded sampler."""
    specs: list[StreamSpec] = []
    for requests in load_workloads(path).values():
        for request in requests:
            tokens = min(request.max_tokens, max_tokens)
            base = StreamSpec("", tokens, messages=request.messages)
            specs.append(base)
            specs.append(
                StreamSpec("", tokens, 0.7, seed=rng.randrange(1 << 31), messages=request.messages)
            )
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=None, help="default: SmolLM2 package")
    parser.add_argument("--model", default=None, help="model id (default: the package's)")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams per round")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--kinds",
        default=None,
        help=f"fault kinds to draw (default: {','.join(LOOPBACK_FAULT_KINDS)}; with --netns "
        f"{','.join(NETNS_FAULT_KINDS)})",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="run each stage on a host of its own (network namespaces; needs root)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=5.0,
        help="the coordinator's --stall-timeout: a hang longer than this fails over",
    )
    parser.add_argument(
        "--embeddings",
        type=int,
        default=2,
        help="embeddings requests among the requests (each of --embedding-inputs texts)",
    )
    parser.add_argument("--embedding-inputs", type=int, default=12)
    parser.add_argument(
        "--features",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add chat requests with n, logprobs, a forced tool call, a JSON schema, "
        "predictions and stop strings (default on)",
    )
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--workloads", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="keep mesh logs here")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "chaos.json")
    args = parser.parse_args(argv)
    default_kinds = NETNS_FAULT_KINDS if args.netns else LOOPBACK_FAULT_KINDS
    kinds = [k for k in (args.kinds or ",".join(default_kinds)).split(",") if k]
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown or not kinds:
        raise SystemExit(f"--kinds takes some of {', '.join(FAULT_KINDS)}")
    rng = random.Random(args.seed)
    package = resolve_package(args.package)
    from mesh.package.manifest import PackageManifest

    model = args.model or PackageManifest.load(package).model_id
    # An instruct model answers chat turns: the varied prompts go as chat messages.
    specs = [
        StreamSpec(
            "", s.max_tokens, s.temperature, s.seed, ({"role": "user", "content": s.prompt},)
        )
        for s in default_specs(8, args.max_tokens, rng)
    ]
    workloads = args.workloads or default_workloads_path()
    if workloads.exists():
        specs += workload_specs(workloads, args.max_tokens, rng)
    if args.features:
        specs += feature_specs(args.max_tokens, rng)
    specs += embedding_specs(args.embeddings, args.embedding_inputs, rng)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mesh-chaos-"))
    hosts = None
    if args.netns:
        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"--netns needs network namespaces: {reason}")
        names = ["head", *(f"worker-{i}" for i in range(1, args.stages))]
        hosts = NetnsHosts(names).create()
        hosts.reach_from_test_process()
    mesh = MeshProcesses(
        package,
        workdir,
        args.stages,
        threads=args.threads,
        max_sessions=args.streams * 2,
        hosts=hosts,
        coordinator_args=("--stall-timeout", f"{args.stall_timeout:g}"),
    )
    started = time.monotonic()
    try:
        mesh.start().wait_serving(deadline_s=900)
        run = ChaosRun(
            mesh, model, specs, rng, streams_per_round=args.streams, full_stages=args.stages
        )
        run.baseline()
        emit(f"baseline: {len(specs)} requests; logs in {workdir}")
        for index in range(args.faults):
            fault = run.pick_fault(rng.choice(kinds))
            record = run.round(fault)
            emit(
                f"[{index + 1}/{args.faults}] {fault.kind} {fault.target} "
                f"{fault.duration_s or ''} -> "
                + " ".join(
                    f"{o} ({k})" for o, k in zip(record.outcomes, record.requests, strict=True)
                )
                + (f", recovered in {record.recovery_s} s" if record.recovery_s else "")
            )
    finally:
        mesh.close()
        if hosts is not None:
            hosts.close()
    summary = summarize(run.records)
    emit(render_table(summary))
    write_json(
        args.out,
        {
            "command": command_line(),
            "machine": machine_info(args.threads),
            "package": str(package),
            "stages": args.stages,
            "hosts": "network namespaces" if args.netns else "loopback",
            "streams_per_round": args.streams,
            "requests": len(specs),
            "wall_s": round(time.monotonic() - started, 1),
            "summary": summary,
            "rounds": [
                {
                    "kind": r.fault.kind,
                    "target": r.fault.target,
                    "duration_s": r.fault.duration_s,
                    "outcomes": r.outcomes,
                    "requests": r.requests,
                    "errors": r.errors,
                    "failover": r.failover,
                    "recovery_s": r.recovery_s,
                }
                for r in run.records
            ],
            "corrupted": [
                {"spec": vars(spec), "expected": vars(exp), "got": vars(got)}
                for spec, exp, got in run.mismatches
            ],
        },
    )
    emit(f"wrote {args.out}")
    return 1 if summary["totals"]["corrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
