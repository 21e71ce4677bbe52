"""Serving under concurrency: time to first token, tokens/s per stream and aggregate
tokens/s for 1, 2, 4 and 8 concurrent streams on a local 2-stage mesh.

Drives the live OpenAI endpoint of stage 0 with the ``openai`` client, streaming, so
time to first token is measured by the client. The requests are the lines of
``workloads.jsonl``. One *pass* runs one workload at one concurrency: ``c`` client
threads take requests from a shared queue holding every line of the workload,
repeated until the count is a multiple of ``c`` (so all ``c`` streams stay busy)
and, with ``--requests-per-stream N``, until each stream has at least N requests (a
longer pass, closer to a sustained load: its start, where every stream's prompt
arrives at once, and its end, where streams finish one by one, weigh less); a pass
ends when the queue is empty and every stream is done. Aggregate tokens/s of
a pass is its completion tokens over its wall time. Each repeat runs every
(concurrency, workload) pass, visiting the concurrencies in a shifted order, after
one warm-up request per workload. The baseline is 1 stream in the same run.
Requests are greedy, so each request's text under several streams is compared with
its own text at 1 stream ("same text as 1 stream": batched steps must not change a
request's tokens). ``--device cuda:0`` (and ``--cuda-graphs``) put the stages on a
GPU (see ``scripts/gpu_mesh_check.sh``).

    .venv/bin/python benchmarks/serving_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import math
import queue
import resource
import threading
import time
from typing import Any

from common import (
    MeshConfig,
    RunningMesh,
    WorkloadRequest,
    add_common_arguments,
    by_label,
    command_line,
    configure,
    cpu_delta,
    cpu_seconds,
    default_workloads_path,
    emit,
    fmt,
    histogram_sums,
    load_average,
    load_workloads,
    machine_info,
    median,
    openai_client,
    ratio,
    render_table,
    resolve_package,
    rotated,
    running_meshes,
    runqueue_wait_seconds,
    scrape_pipeline_metrics,
    spread,
    with_recovery,
    write_json,
)

from mesh.package.manifest import PackageManifest

logger = logging.getLogger("serving_bench")


def pass_requests(
    requests: list[WorkloadRequest], concurrency: int, per_stream: int = 1
) -> list[WorkloadRequest]:
    """Every request of the workload, cycled up to the next multiple of ``concurrency``
    and to at least ``per_stream`` requests per stream."""
    count = max(math.ceil(len(requests) / concurrency), per_stream) * concurrency
    return [requests[i % len(requests)] for i in range(count)]


def stream_one(
    client, model_id: str, request: WorkloadRequest, max_tokens: int | None
) -> dict[str, Any]:
    """One streaming chat completion, timed by the client."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model_id,
        messages=list(request.messages),
        max_tokens=min(request.max_tokens, max_tokens) if max_tokens else request.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first = last = None
    usage = None
    timings: dict[str, Any] = {}
    parts: list[str] = []
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else now
            last = now
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        extra = (chunk.model_extra or {}).get("timings")
        if extra:
            timings = extra
    ended = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else 0
    decode_s = (last - first) if first is not None and last is not None else 0.0
    return {
        "id": request.request_id,
        "text": "".join(parts),
        "started": started,
        "ended": ended,
        "completion_tokens": tokens,
        "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
        "ttft_s": (first - started) if first is not None else math.nan,
        "stream_tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else math.nan,
        "server_predicted_per_second": timings.get("predicted_per_second"),
    }


def run_pass(
    mesh: RunningMesh,
    requests: list[WorkloadRequest],
    concurrency: int,
    max_tokens: int | None,
    per_stream: int = 1,
) -> dict[str, Any]:
    """``concurrency`` streams over the pass's requests; aggregate and per-request figures."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for request in pass_requests(requests, concurrency, per_stream):
        work.put(request)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        client = openai_client(mesh.http_url)
        while True:
            try:
                request = work.get_nowait()
            except queue.Empty:
                return
            try:
                result = stream_one(client, mesh.model_id, request, max_tokens)
            except Exception as error:  # noqa: BLE001 - reported after the pass
                with lock:
                    errors.append(error)
                return
            with lock:
                results.append(result)

    pids = mesh.pids()
    metrics_before = scrape_pipeline_metrics(mesh.http_url)
    cpu_before = cpu_seconds(pids)
    wait_before = runqueue_wait_seconds(pids)
    client_before = _own_cpu_seconds()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    cpu = cpu_delta(cpu_before, cpu_seconds(pids))
    waited = cpu_delta(wait_before, runqueue_wait_seconds(pids))
    client_cpu = _own_cpu_seconds() - client_before
    metrics_after = scrape_pipeline_metrics(mesh.http_url)
    if errors:
        logger.warning(
            "%s request(s) failed at concurrency %s; first: %r", len(errors), concurrency, errors[0]
        )
        raise errors[0]
    busy_ms = by_label(
        histogram_sums(metrics_before.stage_compute_ms, metrics_after.stage_compute_ms), "stage"
    )
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "aggregate_tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "stage_busy_fraction": {k: v / 1000.0 / wall_s for k, v in busy_ms.items()},
        "cpu_cores_used": {k: v / wall_s for k, v in cpu.items()} | {"client": client_cpu / wall_s},
        "runqueue_wait_fraction": {k: v / wall_s for k, v in waited.items()},
        "results": sorted(results, key=lambda r: r["started"]),
    }


def _own_cpu_seconds() -> float:
    """CPU seconds of this process (the client threads), user plus system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    mesh: RunningMesh,
    workloads: dict[str, list[WorkloadRequest]],
    concurrencies: list[int],
    repeats: int,
    max_tokens: int | None,
    per_stream: int = 1,
) -> list[dict[str, Any]]:
    client = openai_client(mesh.http_url)
    for name, requests in workloads.items():
        logger.info("warm-up: %s", name)
        with_recovery(
            mesh,
            f"warm-up {name}",
            lambda r=requests[0]: stream_one(client, mesh.model_id, r, max_tokens),
        )
    passes = []
    for repeat in range(repeats):
        for concurrency in rotated(concurrencies, repeat):
            for name, requests in workloads.items():
                result = with_recovery(
                    mesh,
                    f"repeat {repeat} {name} x{concurrency}",
                    lambda r=requests, c=concurrency: run_pass(mesh, r, c, max_tokens, per_stream),
                )
                result.update(repeat=repeat, workload=name)
                logger.info(
                    "repeat %s %s x%s: %s tokens in %.1fs, %.2f tok/s aggregate",
                    repeat,
                    name,
                    concurrency,
                    result["completion_tokens"],
                    result["wall_s"],
                    result["aggregate_tokens_per_s"],
                )
                passes.append(result)
    return passes


def alternate(
    meshes: list[RunningMesh],
    workloads: dict[str, list[WorkloadRequest]],
    concurrencies: list[int],
    repeats: int,
    max_tokens: int | None,
    per_stream: int = 1,
) -> list[dict[str, Any]]:
    """One repeat of every pass on each mesh in turn (the order shifting by repeat),
    each pass tagged with its mesh's setting (``MeshConfig.setting``)."""
    passes = []
    for repeat in range(repeats):
        for mesh in rotated(meshes, repeat):
            for result in measure(mesh, workloads, concurrencies, 1, max_tokens, per_stream):
                result.update(repeat=repeat, setting=mesh.config.setting)
                passes.append(result)
    return passes


def price_table(by_mode: dict[str, list[dict[str, Any]]]) -> str:
    """Aggregate tok/s and median TTFT of each setting against the first one."""
    modes = list(by_mode)
    base = {(r["workload"], r["concurrency"]): r for r in by_mode[modes[0]]}
    headers = ["workload", "streams"]
    for mode in modes[1:]:
        headers += [f"tok/s {mode} / {modes[0]}", f"TTFT {mode} / {modes[0]}"]
    body = []
    for key, first in base.items():
        line = [key[0], str(key[1])]
        for mode in modes[1:]:
            other = next(
                (r for r in by_mode[mode] if (r["workload"], r["concurrency"]) == key), None
            )
            if other is None:
                line += ["-", "-"]
                continue
            line.append(
                fmt(
                    ratio(
                        other["aggregate_tokens_per_s"]["median"],
                        first["aggregate_tokens_per_s"]["median"],
                    ),
                    3,
                )
            )
            line.append(fmt(ratio(other["ttft_s"]["median"], first["ttft_s"]["median"]), 3))
        body.append(line)
    return render_table(headers, body)


def summarize(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, concurrency): medians over repeats (aggregate) and over every
    request of every repeat (TTFT, per-stream tokens/s), with ratios to 1 stream."""
    rows = []
    keys = sorted({(p["workload"], p["concurrency"]) for p in passes})
    for workload, concurrency in keys:
        mine = [p for p in passes if p["workload"] == workload and p["concurrency"] == concurrency]
        requests = [r for p in mine for r in p["results"]]
        stages = sorted({s for p in mine for s in p["stage_busy_fraction"]})
        roles = sorted({s for p in mine for s in p["cpu_cores_used"]})
        waiting = sorted({s for p in mine for s in p.get("runqueue_wait_fraction", {})})
        rows.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "aggregate_tokens_per_s": spread([p["aggregate_tokens_per_s"] for p in mine]),
                "ttft_s": spread([r["ttft_s"] for r in requests]),
                "stream_tokens_per_s": spread([r["stream_tokens_per_s"] for r in requests]),
                "server_predicted_per_second": median(
                    [r["server_predicted_per_second"] or math.nan for r in requests]
                ),
                "completion_tokens_per_request": median([r["completion_tokens"] for r in requests]),
                "stage_busy_fraction": {
                    s: median([p["stage_busy_fraction"].get(s, math.nan) for p in mine])
                    for s in stages
                },
                "cpu_cores_used": {
                    s: median([p["cpu_cores_used"].get(s, math.nan) for p in mine]) for s in roles
                },
                "runqueue_wait_fraction": {
                    s: median([p.get("runqueue_wait_fraction", {}).get(s, math.nan) for p in mine])
                    for s in waiting
                },
            }
        )
    for row in rows:
        base = next(
            (r for r in rows if r["workload"] == row["workload"] and r["concurrency"] == 1), None
        )
        if base is None:
            continue
        row["aggregate_ratio_vs_1_stream"] = ratio(
            row["aggregate_tokens_per_s"]["median"], base["aggregate_tokens_per_s"]["median"]
        )
        per_repeat = []
        for p in passes:
            if p["workload"] != row["workload"] or p["concurrency"] != row["concurrency"]:
                continue
            solo = next(
                (
                    q
                    for q in passes
                    if q["workload"] == p["workload"]
                    and q["concurrency"] == 1
                    and q["repeat"] == p["repeat"]
                ),
                None,
            )
            if solo is not None:
                per_repeat.append(
                    ratio(p["aggregate_tokens_per_s"], solo["aggregate_tokens_per_s"])
                )
        row["aggregate_ratio_per_repeat"] = spread(per_repeat)
    _same_text(rows, passes)
    return rows


def _same_text(rows: list[dict[str, Any]], passes: list[dict[str, Any]]) -> None:
    """``same_text_as_1_stream`` of every row: ``[equal, compared]``, the requests of
    its passes whose text (greedy) equals the same request's first text at 1 stream.
    Batched steps must not change a request's tokens: a count below ``compared``
    says they did (the 1-stream passes are compared with their first repeat, too)."""
    alone: dict[tuple[str, str], str] = {}
    for p in sorted(passes, key=lambda p: p["repeat"]):
        if p["concurrency"] == 1:
            for r in p["results"]:
                alone.setdefault((p["workload"], r["id"]), r["text"])
    for row in rows:
        equal = compared = 0
        for p in passes:
            if p["workload"] != row["workload"] or p["concurrency"] != row["concurrency"]:
                continue
            for r in p["results"]:
                reference = alone.get((p["workload"], r["id"]))
                if reference is None:
                    continue
                compared += 1
                equal += r["text"] == reference
        row["same_text_as_1_stream"] = [equal, compared]


def table(rows: list[dict[str, Any]]) -> str:
    """Throughput and latency per workload and stream count, against 1 stream."""
    headers = [
        "workload",
        "streams",
        "aggregate tok/s",
        "vs 1 stream",
        "ratio min-max",
        "TTFT s (median)",
        "TTFT s (max)",
        "tok/s per stream",
        "tokens/request",
        "same text as 1 stream",
    ]
    body = []
    for row in rows:
        per_repeat = row.get("aggregate_ratio_per_repeat") or {}
        equal, compared = row.get("same_text_as_1_stream", (0, 0))
        body.append(
            [
                row["workload"],
                str(row["concurrency"]),
                fmt(row["aggregate_tokens_per_s"]["median"]),
                fmt(row.get("aggregate_ratio_vs_1_stream"), 2),
                f"{fmt(per_repeat.get('min'))}-{fmt(per_repeat.get('max'))}",
                fmt(row["ttft_s"]["median"]),
                fmt(row["ttft_s"]["max"]),
                fmt(row["stream_tokens_per_s"]["median"]),
                fmt(row["completion_tokens_per_request"], 0),
                f"{equal}/{compared}" if compared else "-",
            ]
        )
    return render_table(headers, body)


def _stages_only(values: dict[str, float]) -> list[float]:
    return [v for k, v in values.items() if k not in ("coordinator", "client")]


def resource_table(rows: list[dict[str, Any]]) -> str:
    """Where the time goes: each stage's compute time, CPU use and CPU wait, as
    fractions of the pass's wall time (stage 0 first)."""
    headers = [
        "workload",
        "streams",
        "stage compute busy",
        "stage CPU cores",
        "stage runqueue wait",
        "client CPU cores",
        "coordinator CPU cores",
    ]
    body = []
    for row in rows:
        cores = row["cpu_cores_used"]
        body.append(
            [
                row["workload"],
                str(row["concurrency"]),
                " / ".join(f"{100 * v:.0f}%" for v in row["stage_busy_fraction"].values()),
                " / ".join(fmt(v) for v in _stages_only(cores)),
                " / ".join(fmt(v) for v in _stages_only(row.get("runqueue_wait_fraction", {}))),
                fmt(cores.get("client")),
                fmt(cores.get("coordinator")),
            ]
        )
    return render_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "serving")
    parser.add_argument("--stages", type=int, default=2, help="stage processes of the mesh")
    parser.add_argument("--wire-dtype", default="f32", help="activation dtype between stages")
    parser.add_argument("--concurrency", default="1,2,4,8", help="stream counts, comma-separated")
    parser.add_argument("--workload", action="append", help="only these workloads (repeatable)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap every request's max_tokens (default: each request's own value)",
    )
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=1,
        help="at least this many requests per stream in a pass (the workload cycled)",
    )
    parser.add_argument(
        "--speculation",
        default="none",
        help="none: plain decode; package: the speculation the package declares; both "
        "(none,package): one mesh each, alternating repeats",
    )
    parser.add_argument(
        "--row-invariant",
        default="auto",
        help="the stages' --row-invariant; several, comma-separated (e.g. off,on), start "
        "one mesh each and measure them in alternating repeats (the price in one run)",
    )
    parser.add_argument(
        "--quantised-kernel",
        default="auto",
        help="the stages' --quantised-kernel; several, comma-separated (e.g. torch,native), "
        "as --row-invariant: one mesh each, alternating repeats",
    )
    parser.add_argument(
        "--transports",
        default="tcp",
        help="the stages' --data-transport; several, comma-separated (tcp,grpc), as "
        "--row-invariant: one mesh each, alternating repeats",
    )
    parser.add_argument(
        "--prompts-ahead",
        default="on",
        help="stage 0's --prompts-ahead: on, off, or both (on,off), as --row-invariant: "
        "one mesh each, alternating repeats",
    )
    parser.add_argument(
        "--inline-frames",
        default="on",
        help="the stages' --inline-frames: on, off, or both (on,off), as --row-invariant: "
        "one mesh each, alternating repeats",
    )
    args = parser.parse_args(argv)
    args.inline_frames = [m for m in args.inline_frames.split(",") if m]
    if not args.inline_frames or set(args.inline_frames) - {"on", "off"}:
        parser.error("--inline-frames takes on, off (comma-separated)")
    args.prompts_ahead = [m for m in args.prompts_ahead.split(",") if m]
    if not args.prompts_ahead or set(args.prompts_ahead) - {"on", "off"}:
        parser.error("--prompts-ahead takes on, off (comma-separated)")
    args.transports = [t for t in args.transports.split(",") if t]
    if not args.transports or set(args.transports) - {"tcp", "grpc"}:
        parser.error("--transports takes tcp, grpc (comma-separated)")
    args.arithmetic = [m for m in args.row_invariant.split(",") if m]
    if not args.arithmetic or set(args.arithmetic) - {"auto", "on", "off"}:
        parser.error("--row-invariant takes auto, on, off (comma-separated)")
    args.speculations = [m for m in args.speculation.split(",") if m]
    if not args.speculations or set(args.speculations) - {"none", "package"}:
        parser.error("--speculation takes none, package (comma-separated)")
    args.kernels = [k for k in args.quantised_kernel.split(",") if k]
    if not args.kernels or set(args.kernels) - {"auto", "native", "torch"}:
        parser.error("--quantised-kernel takes auto, native, torch (comma-separated)")
    args.concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if 1 not in args.concurrencies:
        parser.error("--concurrency must include 1: it is the baseline")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args)
    package = resolve_package(args.package)
    manifest = PackageManifest.load(package)
    workloads = load_workloads(args.workloads or default_workloads_path())
    if args.workload:
        missing = sorted(set(args.workload) - set(workloads))
        if missing:
            raise SystemExit(f"unknown workload(s) {missing}; the file has {sorted(workloads)}")
        workloads = {k: v for k, v in workloads.items() if k in args.workload}
    configs = [
        MeshConfig(
            args.stages,
            args.wire_dtype,
            spec,
            mode,
            quantised_kernel=kernel,
            data_transport=transport,
            prompts_ahead=ahead == "on",
            inline_frames=inline == "on",
        )
        for spec in args.speculations
        for mode in args.arithmetic
        for kernel in args.kernels
        for transport in args.transports
        for ahead in args.prompts_ahead
        for inline in args.inline_frames
    ]
    settings = [c.setting for c in configs]
    config = configs[0]
    machine = machine_info(args.threads)
    started = time.time()
    with running_meshes(
        package,
        configs,
        threads=args.threads,
        workdir=args.workdir,
        max_sessions=max(16, max(args.concurrencies)),
        heartbeat_timeout_s=args.heartbeat_timeout,
    ) as meshes:
        plan = (
            workloads, args.concurrencies, args.repeats, args.max_tokens,
            args.requests_per_stream,
        )  # fmt: skip
        if len(meshes) == 1:
            passes = measure(meshes[0], *plan)
        else:
            passes = alternate(meshes, *plan)
        interruptions = [i for mesh in meshes for i in mesh.interruptions]
    by_mode = {
        setting: summarize([p for p in passes if p.get("setting", setting) == setting])
        for setting in settings
    }
    rows = by_mode[settings[0]]
    machine["load_average_at_end"] = load_average()
    payload = {
        "benchmark": "serving",
        "command": command_line(),
        "machine": machine,
        "settings": {
            "model_id": manifest.model_id,
            "stages": args.stages,
            "wire_dtype": args.wire_dtype,
            "speculation": args.speculation,
            "concurrency": args.concurrencies,
            "repeats": args.repeats,
            "max_tokens_cap": args.max_tokens,
            "workloads": {k: len(v) for k, v in workloads.items()},
            "duration_s": round(time.time() - started, 1),
        },
        "summary": rows,
        "summary_by_setting": by_mode,
        "interruptions": interruptions,
        "passes": passes,
    }
    write_json(args.out, payload)
    emit(
        f"serving benchmark: {manifest.model_id}, {config.label}, "
        f"{args.threads} torch thread(s) per stage"
    )
    for mode, mode_rows in by_mode.items():
        if len(by_mode) > 1:
            emit(f"\nspeculation/row-invariant/kernel {mode}")
        emit(table(mode_rows))
        emit("")
        emit(resource_table(mode_rows))
    if len(by_mode) > 1:
        emit("")
        emit(price_table(by_mode))
    emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
