"""Decode speed of the mesh against its stage count, and what a stage boundary costs.

Starts one local mesh (real coordinator and stage processes on 127.0.0.1) per
configuration, all at the same time, and drives greedy decode through each one's
OpenAI endpoint with the ``openai`` client: one warm-up request per mesh, then
``--repeats`` rounds in which every mesh serves the same request (visiting the meshes
in a shifted order each round). The primary figure is the server's decode-only
``timings.predicted_per_second``; the client's wall time is reported beside it.

Reported per configuration: median decode tok/s, its ratio to 1 stage (f32), the
per-hop overhead ``(t_per_token(N) - t_per_token(1)) / (N - 1)``, and a breakdown of
one decode round from stage 0's ``/metrics`` (round time, compute per stage, and the
rest: wire encoding, gRPC, queues and thread hand-offs). Also: bytes per token per
stage boundary for each wire dtype, from ``mesh.codec.bytes_per_token`` and from the
encoded size of a real decode frame, with the frame's encode+decode time.

    .venv/bin/python benchmarks/pipeline_bench.py --repeats 5 --wire-sweep
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import uuid
from typing import Any

import torch
from common import (
    MeshConfig,
    PipelineMetrics,
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
    histogram_means,
    label_value,
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

from mesh.codec import (
    Frame,
    FrameResult,
    Segment,
    SegmentKind,
    SegmentResult,
    StageTiming,
    WireDType,
    bytes_per_token,
    frame_from_proto,
    frame_to_proto,
    result_to_proto,
)
from mesh.package.manifest import PackageManifest

logger = logging.getLogger("pipeline_bench")

WIRE_DTYPES = ("f32", "f16", "bf16", "int8")
FRAME_TIMING_ITERATIONS = 2000


def build_configs(
    stage_counts: list[int],
    wire_sweep: bool,
    kernel: str = "auto",
    transports: tuple[str, ...] = ("tcp",),
    inline: tuple[bool, ...] = (True,),
) -> list[MeshConfig]:
    """f32 meshes for each stage count (split meshes once per data transport and per
    ``--inline-frames`` choice), plus 2-stage meshes for the other wire dtypes; every
    stage with ``--quantised-kernel kernel``."""
    configs = [MeshConfig(1, "f32", quantised_kernel=kernel)] if 1 in stage_counts else []
    configs += [
        MeshConfig(n, "f32", quantised_kernel=kernel, data_transport=t, inline_frames=i)
        for n in stage_counts
        if n > 1
        for t in transports
        for i in inline
    ]
    if wire_sweep:
        configs += [MeshConfig(2, w, quantised_kernel=kernel) for w in WIRE_DTYPES if w != "f32"]
    return configs


def pick_prompt(workloads: dict[str, list[WorkloadRequest]], request_id: str | None):
    chat = workloads.get("chat")
    if not chat:
        raise SystemExit("the workload file has no 'chat' requests to take the prompt from")
    if request_id is None:
        return chat[0]
    for request in chat:
        if request.request_id == request_id:
            return request
    raise SystemExit(f"no chat request with id {request_id!r}")


def _chat(mesh: RunningMesh, prompt: WorkloadRequest, max_tokens: int):
    client = openai_client(mesh.http_url)
    return client.chat.completions.create(
        model=mesh.model_id,
        messages=list(prompt.messages),
        max_tokens=max_tokens,
        temperature=0,
    )


def _compute_totals(mesh: RunningMesh) -> dict[str, tuple[float, float]]:
    return _compute_totals_from(scrape_pipeline_metrics(mesh.http_url))


def decode_once(mesh: RunningMesh, prompt: WorkloadRequest, max_tokens: int) -> dict[str, Any]:
    """One greedy, non-streaming chat completion: the server's timings, the client's
    wall time, and a decode-round breakdown from stage 0's metrics.

    The per-stage compute histogram mixes the prefill frame with the decode frames,
    so a one-token request with the same prompt first measures the prefill's compute
    on each stage, which is then taken out of the measured request's totals."""
    probe_before = _compute_totals(mesh)
    _chat(mesh, prompt, 1)
    before = scrape_pipeline_metrics(mesh.http_url)
    prefill = {
        stage: total - probe_before.get(stage, (0.0, 0.0))[0]
        for stage, (total, _) in _compute_totals_from(before).items()
    }
    pids = mesh.pids()
    cpu_before = cpu_seconds(pids)
    wait_before = runqueue_wait_seconds(pids)
    started = time.perf_counter()
    reply = _chat(mesh, prompt, max_tokens)
    wall_s = time.perf_counter() - started
    cpu = cpu_delta(cpu_before, cpu_seconds(pids))
    waited = cpu_delta(wait_before, runqueue_wait_seconds(pids))
    after = scrape_pipeline_metrics(mesh.http_url)
    timings = (reply.model_extra or {}).get("timings") or {}
    rounds = by_label(histogram_means(before.round_ms, after.round_ms), "kind")
    compute = {}
    old = _compute_totals_from(before)
    for stage, (total, count) in _compute_totals_from(after).items():
        old_total, old_count = old.get(stage, (0.0, 0.0))
        frames = count - old_count - 1  # the measured request's decode frames
        if frames > 0:
            compute[stage] = (total - old_total - prefill.get(stage, 0.0)) / frames
    tokens = reply.usage.completion_tokens
    return {
        "completion_tokens": tokens,
        "prompt_tokens": reply.usage.prompt_tokens,
        "predicted_n": timings.get("predicted_n"),
        "predicted_ms": timings.get("predicted_ms"),
        "predicted_per_second": timings.get("predicted_per_second"),
        "prompt_ms": timings.get("prompt_ms"),
        "wall_s": wall_s,
        "wall_tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "decode_round_ms": rounds.get("decode"),
        "prefill_compute_ms": dict(sorted(prefill.items())),
        "stage_compute_ms": dict(sorted(compute.items())),
        "cpu_ms_per_token": {role: 1000.0 * used / max(1, tokens) for role, used in cpu.items()},
        "runqueue_wait_ms_per_token": {
            role: 1000.0 * used / max(1, tokens) for role, used in waited.items()
        },
        "text": reply.choices[0].message.content or "",
    }


def _compute_totals_from(scrape: PipelineMetrics) -> dict[str, tuple[float, float]]:
    return {
        label_value(labels, "stage") or labels: pair
        for labels, pair in scrape.stage_compute_ms.items()
    }


def measure(
    meshes: list[RunningMesh], prompt: WorkloadRequest, max_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    runs = []
    for mesh in meshes:
        logger.info("warm-up: %s", mesh.config.label)
        with_recovery(mesh, "warm-up", lambda m=mesh: decode_once(m, prompt, max_tokens))
    for repeat in range(repeats):
        for mesh in rotated(meshes, repeat):
            run = with_recovery(
                mesh,
                f"repeat {repeat}",
                lambda m=mesh: decode_once(m, prompt, max_tokens),
            )
            run.update(
                repeat=repeat,
                stages=mesh.config.stages,
                wire=mesh.config.wire_dtype,
                transport=mesh.config.data_transport,
                inline=mesh.config.inline_frames,
            )
            logger.info(
                "repeat %s %s: %.2f tok/s", repeat, mesh.config.label, run["predicted_per_second"]
            )
            runs.append(run)
    return runs


def summarize(configs: list[MeshConfig], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: medians over repeats and the derived ratios and overheads."""
    rows = []
    for config in configs:
        mine = [
            r
            for r in runs
            if _key(r)
            == (config.stages, config.wire_dtype, config.data_transport, config.inline_frames)
        ]
        tok_s = median([r["predicted_per_second"] for r in mine])
        compute = {
            stage: median([r["stage_compute_ms"].get(stage, float("nan")) for r in mine])
            for stage in sorted({s for r in mine for s in r["stage_compute_ms"]})
        }
        round_ms = median([r["decode_round_ms"] or float("nan") for r in mine])
        cpu = {
            role: median([r["cpu_ms_per_token"].get(role, float("nan")) for r in mine])
            for role in mine[0]["cpu_ms_per_token"]
        }
        rows.append(
            {
                "stages": config.stages,
                "wire": config.wire_dtype,
                "transport": config.data_transport,
                "inline": config.inline_frames,
                "label": config.label,
                "decode_tokens_per_s": spread([r["predicted_per_second"] for r in mine]),
                "ms_per_token": 1000.0 / tok_s if tok_s else float("nan"),
                "wall_tokens_per_s": spread([r["wall_tokens_per_s"] for r in mine]),
                "decode_round_ms": round_ms,
                "stage_compute_ms": compute,
                "round_minus_compute_ms": round_ms - sum(compute.values()),
                "cpu_ms_per_token": cpu,
                "stage_cpu_ms_per_token": sum(v for k, v in cpu.items() if k != "coordinator"),
                "runqueue_wait_ms_per_token": {
                    role: median(
                        [r["runqueue_wait_ms_per_token"].get(role, math.nan) for r in mine]
                    )
                    for role in mine[0]["runqueue_wait_ms_per_token"]
                    if role != "coordinator"
                },
                "same_text_as_1_stage": None,
            }
        )
    base = next((r for r in rows if r["stages"] == 1 and r["wire"] == "f32"), None)
    base_text = _texts(runs, (1, "f32", "tcp", True))
    for row in rows:
        if base is None:
            break
        tok_s = row["decode_tokens_per_s"]["median"]
        row["ratio_vs_1_stage"] = ratio(tok_s, base["decode_tokens_per_s"]["median"])
        row["wall_ratio_vs_1_stage"] = ratio(
            row["wall_tokens_per_s"]["median"], base["wall_tokens_per_s"]["median"]
        )
        hops = row["stages"] - 1
        row["per_hop_overhead_ms"] = (
            (row["ms_per_token"] - base["ms_per_token"]) / hops if hops else float("nan")
        )
        row["per_hop_cpu_ms"] = (
            (row["stage_cpu_ms_per_token"] - base["stage_cpu_ms_per_token"]) / hops
            if hops
            else float("nan")
        )
        row["same_text_as_1_stage"] = _texts(runs, _key(row)) == base_text
    return rows


def _key(run: dict[str, Any]) -> tuple[int, str, str, bool]:
    """(stages, wire dtype, data transport, frames inline) of a run or a row."""
    return run["stages"], run["wire"], run.get("transport", "tcp"), run.get("inline", True)


def _texts(runs: list[dict[str, Any]], key: tuple[int, str, str, bool]) -> set[str]:
    return {r["text"] for r in runs if _key(r) == key}


def wire_sizes(
    hidden_size: int,
    prompt_tokens: int,
    decode_tokens: int,
    iterations: int = FRAME_TIMING_ITERATIONS,
) -> list[dict[str, Any]]:
    """Bytes per decode token crossing one boundary, per wire dtype: the activation
    payload (``bytes_per_token``) and the whole encoded decode frame as stage k sends
    it to stage k+1 (ids, one StageTiming, token id), plus its encode+decode time."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    hidden = torch.randn(1, hidden_size)
    position = prompt_tokens + decode_tokens
    segment = Segment(request_id, request_id, SegmentKind.DECODE, position, (12345,))
    frame = Frame(
        term=1,
        frame_id=1,
        segments=(segment,),
        hidden=hidden,
        timings=(StageTiming(stage_index=0, compute_ms=41.5, queue_ms=0.2),),
    )
    answer = SegmentResult(request_id, request_id, position + 1, (12345,))
    result = FrameResult(
        1, 1, (answer,), timings=(StageTiming(0, 41.5, 0.2), StageTiming(1, 40.1, 0.3))
    )
    rows = []
    for wire in WIRE_DTYPES:
        pb = frame_to_proto(frame, wire)
        payload = bytes_per_token(hidden_size, wire)
        rows.append(
            {
                "wire": wire,
                "bytes_per_token": payload,
                "decode_frame_bytes": pb.ByteSize(),
                "frame_overhead_bytes": pb.ByteSize() - payload,
                "return_result_bytes": result_to_proto(result).ByteSize(),
                "encode_decode_us": _codec_time_us(frame, WireDType.parse(wire), iterations),
            }
        )
    return rows


def _codec_time_us(frame: Frame, wire: WireDType, iterations: int) -> float:
    """Median time to encode a decode frame to bytes and decode it back, in us."""
    from mesh.proto.v1 import data_pb2

    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        data = frame_to_proto(frame, wire).SerializeToString()
        frame_from_proto(data_pb2.Frame.FromString(data))
        samples.append(time.perf_counter() - started)
    return median(samples) * 1e6


def _config_name(row: dict[str, Any]) -> str:
    over = "" if row.get("transport", "tcp") == "tcp" else f" over {row['transport']}"
    if not row.get("inline", True):
        over += " frames on worker"
    return f"{row['stages']} stage{'s' if row['stages'] > 1 else ''} {row['wire']}{over}"


def stage_table(rows: list[dict[str, Any]]) -> str:
    """Decode speed per configuration against 1 stage."""
    headers = [
        "config",
        "decode tok/s",
        "min-max",
        "vs 1 stage",
        "ms/token",
        "per-hop ms",
        "wall tok/s",
        "wall vs 1 stage",
        "same text",
    ]
    body = []
    for row in rows:
        tok = row["decode_tokens_per_s"]
        body.append(
            [
                _config_name(row),
                fmt(tok["median"]),
                f"{fmt(tok['min'])}-{fmt(tok['max'])}",
                fmt(row.get("ratio_vs_1_stage"), 3),
                fmt(row["ms_per_token"], 1),
                fmt(row.get("per_hop_overhead_ms"), 1),
                fmt(row["wall_tokens_per_s"]["median"]),
                fmt(row.get("wall_ratio_vs_1_stage"), 3),
                "yes" if row["same_text_as_1_stage"] else "no",
            ]
        )
    return render_table(headers, body)


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """Where a decode round goes: wall time per stage and CPU time per process."""
    headers = [
        "config",
        "round ms",
        "compute ms per stage",
        "round - compute ms",
        "CPU ms/token per stage",
        "CPU ms/token, all stages",
        "CPU per hop ms",
        "runqueue wait ms/token per stage",
        "coordinator CPU ms/token",
    ]
    body = []
    for row in rows:
        cpu = row["cpu_ms_per_token"]
        body.append(
            [
                _config_name(row),
                fmt(row["decode_round_ms"], 1),
                " + ".join(fmt(v, 1) for v in row["stage_compute_ms"].values()),
                fmt(row["round_minus_compute_ms"], 1),
                " + ".join(fmt(v, 1) for k, v in cpu.items() if k != "coordinator"),
                fmt(row["stage_cpu_ms_per_token"], 1),
                fmt(row.get("per_hop_cpu_ms"), 1),
                " + ".join(fmt(v, 1) for v in row["runqueue_wait_ms_per_token"].values()),
                fmt(cpu.get("coordinator"), 2),
            ]
        )
    return render_table(headers, body)


def wire_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "wire",
        "payload B/token",
        "decode frame B",
        "frame overhead B",
        "return result B",
        "encode+decode us",
    ]
    body = [
        [
            r["wire"],
            str(r["bytes_per_token"]),
            str(r["decode_frame_bytes"]),
            str(r["frame_overhead_bytes"]),
            str(r["return_result_bytes"]),
            fmt(r["encode_decode_us"], 1),
        ]
        for r in rows
    ]
    return render_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "pipeline")
    parser.add_argument("--stages", default="1,2,3", help="stage counts, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per request")
    parser.add_argument("--prompt-id", default=None, help="chat request id (default: the first)")
    parser.add_argument(
        "--wire-sweep", action="store_true", help="also 2 stages with f16, bf16 and int8"
    )
    parser.add_argument(
        "--quantised-kernel",
        choices=("auto", "native", "torch"),
        default="auto",
        help="the stages' --quantised-kernel (int4/int8 packages)",
    )
    parser.add_argument(
        "--transports",
        default="tcp",
        help="data transports of the split meshes, comma-separated: tcp, grpc",
    )
    parser.add_argument(
        "--inline-frames",
        default="on",
        help="the split meshes' --inline-frames, comma-separated: on, off (both: one mesh "
        "each, same run)",
    )
    args = parser.parse_args(argv)
    choices = [c.strip() for c in args.inline_frames.split(",") if c.strip()]
    if not choices or set(choices) - {"on", "off"}:
        parser.error("--inline-frames takes on and/or off")
    args.inline = tuple(c == "on" for c in dict.fromkeys(choices))
    args.transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    if not args.transports or set(args.transports) - {"tcp", "grpc"}:
        parser.error("--transports takes tcp and/or grpc")
    args.stage_counts = sorted({int(s) for s in args.stages.split(",") if s.strip()})
    if 1 not in args.stage_counts:
        parser.error("--stages must include 1: it is the baseline")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args)
    package = resolve_package(args.package)
    manifest = PackageManifest.load(package)
    workloads = load_workloads(args.workloads or default_workloads_path())
    prompt = pick_prompt(workloads, args.prompt_id)
    configs = build_configs(
        args.stage_counts, args.wire_sweep, args.quantised_kernel, args.transports, args.inline
    )
    machine = machine_info(args.threads)
    started = time.time()
    with running_meshes(
        package,
        configs,
        threads=args.threads,
        workdir=args.workdir,
        heartbeat_timeout_s=args.heartbeat_timeout,
    ) as meshes:
        runs = measure(meshes, prompt, args.max_tokens, args.repeats)
        interruptions = {m.config.label: list(m.interruptions) for m in meshes}
    rows = summarize(configs, runs)
    sizes = wire_sizes(manifest.hidden_size, runs[0]["prompt_tokens"], args.max_tokens // 2)
    machine["load_average_at_end"] = load_average()
    payload = {
        "benchmark": "pipeline",
        "command": command_line(),
        "machine": machine,
        "settings": {
            "model_id": manifest.model_id,
            "layers": manifest.layer_count,
            "hidden_size": manifest.hidden_size,
            "model_dtype": manifest.dtype,
            "prompt_id": prompt.request_id,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "speculation": "none",
            "configs": [c.label for c in configs],
            "duration_s": round(time.time() - started, 1),
        },
        "summary": rows,
        "wire_sizes": sizes,
        "interruptions": interruptions,
        "runs": runs,
    }
    write_json(args.out, payload)
    emit(f"pipeline benchmark: {manifest.model_id}, {args.threads} torch thread(s) per stage")
    emit(stage_table(rows))
    emit("")
    emit(breakdown_table(rows))
    emit("")
    emit(wire_table(sizes))
    emit(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
