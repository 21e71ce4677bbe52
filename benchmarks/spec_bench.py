"""Speculative decoding on a 2-stage mesh: tok/s, acceptance and speedup over plain
decoding, per workload and per injected network latency.

For each latency (``--inject-delay-ms`` on every stage: every Forward and Return hop
waits that long) it starts one local mesh per speculation configuration, all at
once, and sends every request of the workload file (greedy, the file's
``max_tokens``) to every mesh: ``--repeats`` rounds, and within a round each request
visits the meshes in a shifted order, so load from elsewhere on the machine falls on
all configurations alike. Per (latency, workload, configuration) it reports the
median over repeats of the workload's tok/s (completion tokens / client wall time,
prefill included), its wall time, the acceptance rate, committed tokens per decode
round and the speedup against the baseline mesh of the same run. Greedy speculation
must not change a token, so it also counts replies whose text differs from the
baseline's.

The matrix can be split and merged:

    .venv/bin/python benchmarks/spec_bench.py --latency-ms 0 --out bench-results/spec-0.json
    .venv/bin/python benchmarks/spec_bench.py --merge bench-results/spec-*.json \\
        --out bench-results/spec_bench.json --chart docs/spec_bench.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common import (
    WorkloadRequest,
    add_common_arguments,
    by_label,
    command_line,
    configure,
    default_workloads_path,
    emit,
    fmt,
    load_average,
    load_workloads,
    machine_info,
    median,
    openai_client,
    parse_histogram_totals,
    render_table,
    resolve_package,
    rotated,
    write_json,
)

logger = logging.getLogger("spec_bench")

BASELINE = "baseline"
MESH_START_DEADLINE_S = 900.0
WARMUP_TOKENS = 16
# Stage 0's speculation counters (summed over strategies and drafters) by short name.
_COUNTERS = {
    "mesh_speculation_drafted_tokens_total": "drafted",
    "mesh_speculation_accepted_tokens_total": "accepted",
    "mesh_speculation_windows_total": "windows",
    "mesh_speculation_rounds_total": "rounds",
    "mesh_speculation_emitted_tokens_total": "emitted",
}
_COUNTER = re.compile(r"^(mesh_speculation_\w+_total)\{[^}]*\} (\S+)$")


@dataclass(frozen=True)
class SpecConfig:
    """One speculation setting of stage 0, as command-line flags."""

    name: str
    label: str
    stage0_args: tuple[str, ...]
    # Send each code-edit request's original code as its ``prediction``.
    prediction: bool = False
    # Coordinator flags (the [frontend] settings it sends stage 0 with its Load).
    coordinator_args: tuple[str, ...] = ()


def with_depths(configs: Sequence[SpecConfig], depths: Sequence[str]) -> list[SpecConfig]:
    """Each speculating configuration once per depth: ``1`` (serial windows: each
    waits for the verdict before it), ``auto`` (the cost rule picks up to the
    default ``max_windows_in_flight``) or a number (the cost rule picks up to it).
    With one depth the names stay as they are."""
    if len(depths) <= 1 and (not depths or depths[0] == "auto"):
        return list(configs)
    out: list[SpecConfig] = []
    for config in configs:
        if config.name == BASELINE:
            out.append(config)
            continue
        for depth in depths:
            flags = () if depth == "auto" else ("--max-windows-in-flight", depth)
            label = "serial windows" if depth == "1" else f"depth {depth}"
            out.append(
                replace(
                    config,
                    name=f"{config.name}@d{depth}",
                    label=f"{config.label}; {label}",
                    coordinator_args=(*config.coordinator_args, *flags),
                )
            )
    return out


def build_configs(
    names: Sequence[str], fixed_window: int, draft_model: str | None, draft_label: str
) -> list[SpecConfig]:
    """The configurations to compare; the baseline always comes first."""
    w = str(fixed_window)
    ngram_off = ("--spec-type", "ngram", "--no-spec-auto")
    known = {
        BASELINE: SpecConfig(BASELINE, "baseline (no speculation)", ("--spec-type", "none")),
        "ngram-fixed": SpecConfig(
            "ngram-fixed",
            f"n-gram, fixed window {w}",
            (*ngram_off, "--window-policy", "fixed", "--initial-window", w),
        ),
        "ngram-adaptive": SpecConfig(
            "ngram-adaptive", "n-gram, adaptive window", (*ngram_off, "--window-policy", "adaptive")
        ),
        "ngram-auto": SpecConfig(
            "ngram-auto",
            "n-gram, auto gating, adaptive window",
            ("--spec-type", "ngram", "--spec-auto", "--window-policy", "adaptive"),
        ),
        "cost": SpecConfig("cost", "default: n-gram, auto gating, cost-aware window", ()),
        "suffix": SpecConfig(
            "suffix",
            "suffix drafter (request + shared corpus), auto gating, cost-aware window",
            ("--spec-type", "suffix"),
        ),
        "local": SpecConfig(
            "local",
            "suffix drafter, request-local (no shared corpus: --corpus-tokens 0)",
            ("--spec-type", "suffix", "--corpus-tokens", "0"),
        ),
        "prediction": SpecConfig(
            "prediction",
            "default + the original code as `prediction` (Predicted Outputs)",
            (),
            prediction=True,
        ),
    }
    if draft_model:
        draft = ("--spec-type", "draft-model", "--draft-model", draft_model)
        known["draft-fixed"] = SpecConfig(
            "draft-fixed",
            f"{draft_label}, fixed window {w}",
            (*draft, "--window-policy", "fixed", "--initial-window", w),
        )
        known["draft-adaptive"] = SpecConfig(
            "draft-adaptive",
            f"{draft_label}, adaptive window",
            (*draft, "--window-policy", "adaptive"),
        )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(known)}"
            + ("" if draft_model else " (draft-fixed and draft-adaptive need --draft-model)")
        )
    return [known[n] for n in dict.fromkeys([BASELINE, *names])]


# ---- one latency: start the meshes, measure every request ---------------------------


def metrics_text(http_url: str) -> str:
    with urllib.request.urlopen(http_url + "/metrics", timeout=30) as reply:
        return reply.read().decode()


def round_breakdown(http_url: str) -> dict[str, dict[str, float]]:
    """Mean pipeline round time by frame kind and mean compute per frame by stage (ms),
    over everything the mesh served."""
    text = metrics_text(http_url)
    out = {}
    for name, key in (
        ("mesh_pipeline_round_seconds", "kind"),
        ("mesh_stage_compute_seconds", "stage"),
    ):
        totals = parse_histogram_totals(text, name, 1000.0)
        means = {labels: s / c for labels, (s, c) in totals.items() if c > 0}
        out[name.replace("_seconds", "_ms")] = by_label(means, key)
    return out


_AHEAD = re.compile(
    r'^mesh_verify_(windows_ahead_total\{outcome="(\w+)"\}|wasted_tokens_total) (\S+)$'
)


def ahead_counters(text: str) -> dict[str, float]:
    """Windows drafted ahead (sent, kept, dropped) and the rows dropped ones wasted,
    from a /metrics body; with the rows of every frame stage 0 sent, for scale."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _AHEAD.match(line)
        if match:
            out[match.group(2) or "wasted_tokens"] = float(match.group(3))
    rows = parse_histogram_totals(text, "mesh_step_tokens", 1.0)
    out["rows_sent"] = sum(total for total, _ in rows.values())
    return out


def scrape_counters(http_url: str) -> dict[str, float]:
    """Stage 0's speculation counters (drafted, accepted, windows, rounds, emitted)."""
    return speculation_counters(metrics_text(http_url))


def speculation_counters(text: str) -> dict[str, float]:
    """The speculation counters of a /metrics body, summed over strategies and drafters."""
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line.strip())
        if match and match.group(1) in _COUNTERS:
            key = _COUNTERS[match.group(1)]
            counters[key] = counters.get(key, 0.0) + float(match.group(2))
    return counters


def speculation_line(log: str) -> str:
    """What stage 0 logged about its resolved speculation config."""
    lines = [ln for ln in log.splitlines() if "stage.frontend.host: speculation" in ln]
    return lines[-1].split("stage.frontend.host: ", 1)[1] if lines else "not logged"


_CODE_BLOCK = re.compile(r"```[\w+-]*\n(.*?)```", re.DOTALL)


def prediction_of(request: WorkloadRequest) -> str | None:
    """The code block of the request's last message (what a code edit returns, edited),
    or None when it has none."""
    content = request.messages[-1].get("content")
    found = _CODE_BLOCK.search(content) if isinstance(content, str) else None
    return found.group(1) if found else None


def measure_one(
    client: Any,
    http_url: str,
    model_id: str,
    request: WorkloadRequest,
    max_tokens: int,
    prediction: bool = False,
    user: str = "warmup",
    messages: Sequence[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """One greedy request. ``user`` scopes what the suffix drafter may learn from:
    each repeat is its own tenant, so a repeat never drafts from the same request's
    earlier answer (requests of one repeat may draw on each other)."""
    extra: dict[str, Any] = {"user": user}
    code = prediction_of(request) if prediction else None
    if code is not None:
        extra["prediction"] = {"type": "content", "content": code}
    before = scrape_counters(http_url)
    started = time.perf_counter()
    reply = client.chat.completions.create(
        model=model_id,
        messages=list(messages if messages is not None else request.messages),
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )
    wall_s = time.perf_counter() - started
    after = scrape_counters(http_url)
    timings = reply.model_extra.get("timings", {})
    text = reply.choices[0].message.content or ""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    return {
        "workload": request.workload,
        "request_id": request.request_id,
        "wall_s": wall_s,
        "completion_tokens": reply.usage.completion_tokens,
        "prompt_tokens": reply.usage.prompt_tokens,
        "finish_reason": reply.choices[0].finish_reason,
        "decode_ms": timings.get("predicted_ms"),
        "drafted": int(timings.get("drafted", 0)),
        "accepted": int(timings.get("accepted", 0)),
        "windows": int(timings.get("windows", 0)),
        "rounds": int(delta.get("rounds", 0)),
        "emitted": int(delta.get("emitted", 0)),
        "text_sha1": hashlib.sha1(text.encode()).hexdigest(),
        "text": text,
        "prediction_accepted": getattr(
            reply.usage.completion_tokens_details, "accepted_prediction_tokens", None
        ),
    }


def run_latency(
    package: Path,
    latency_ms: float,
    configs: Sequence[SpecConfig],
    requests: Sequence[WorkloadRequest],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every request x config x repeat at one injected latency."""
    from coordinator.localmesh import MeshProcesses

    records: list[dict[str, Any]] = []
    with ExitStack() as stack:
        temporary = tempfile.TemporaryDirectory(prefix="spec-bench-")
        root = args.workdir or Path(stack.enter_context(temporary))
        meshes = {}
        for config in configs:
            mesh = MeshProcesses(
                package,
                root / f"lat{latency_ms:g}-{config.name}",
                2,
                threads=args.threads,
                max_sessions=4,
                max_queued=4,
                stage0_args=config.stage0_args,
                coordinator_args=config.coordinator_args,
                stage_args=("--inject-delay-ms", f"{latency_ms:g}"),
            )
            stack.callback(mesh.close)
            meshes[config.name] = mesh.start()
        served = {}
        for name, mesh in meshes.items():
            body = mesh.wait_serving(deadline_s=MESH_START_DEADLINE_S)
            served[name] = (mesh.http_url, body["model_id"], openai_client(mesh.http_url))
            logger.info("latency %s ms: %s serving at %s", latency_ms, name, mesh.http_url)
        resolved = {n: speculation_line(m.stage_log("stage-0")) for n, m in meshes.items()}
        for url, model_id, client in served.values():
            measure_one(client, url, model_id, requests[0], WARMUP_TOKENS)
        for repeat in range(args.repeats):
            for index, request in enumerate(requests):
                tokens = args.max_tokens or request.max_tokens
                for config in rotated(list(configs), repeat + index):
                    url, model_id, client = served[config.name]
                    turns = [(request.workload, None)]
                    for workload, messages in turns:
                        record = measure_one(
                            client, url, model_id, request, tokens, config.prediction,
                            f"r{repeat}", messages,
                        )  # fmt: skip
                        text = record.pop("text")
                        record.update(
                            workload=workload, latency_ms=latency_ms, config=config.name,
                            repeat=repeat,
                        )  # fmt: skip
                        records.append(record)
                        logger.info(
                            "%s ms %s %s %s r%s: %s tokens in %.2fs",
                            latency_ms, config.name, workload, request.request_id, repeat,
                            record["completion_tokens"], record["wall_s"],
                        )  # fmt: skip
                        if request.follow_up and messages is None:
                            # The second turn: the model's answer, then the next edit.
                            second = [
                                *request.messages,
                                {"role": "assistant", "content": text},
                                {"role": "user", "content": request.follow_up},
                            ]
                            turns.append((f"{request.workload}-turn2", second))
        rounds = {name: round_breakdown(url) for name, (url, _, _) in served.items()}
        ahead = {name: ahead_counters(metrics_text(url)) for name, (url, _, _) in served.items()}
    return records, {"speculation": resolved, "round_ms": rounds, "ahead": ahead}


# ---- summary, table, chart ------------------------------------------------------------


def _per_repeat(items: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    repeats: dict[int, list[dict[str, Any]]] = {}
    for item in items:
        repeats.setdefault(item["repeat"], []).append(item)
    return repeats


def _rate(items: Sequence[dict[str, Any]]) -> float:
    return sum(i["completion_tokens"] for i in items) / sum(i["wall_s"] for i in items)


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (latency, workload, config): medians over repeats of the workload's
    tok/s and wall time, acceptance, tokens per round, the speedup over the baseline of
    the same latency (ratio of medians; ``speedup_paired`` is the median of per-repeat
    ratios), and how many replies differ from the baseline's."""
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for record in records:
        key = (record["latency_ms"], record["workload"], record["config"])
        groups.setdefault(key, []).append(record)
    texts = {
        (r["latency_ms"], r["workload"], r["request_id"], r["repeat"]): r["text_sha1"]
        for r in records
        if r["config"] == BASELINE
    }
    rows = []
    for (latency, workload, config), items in groups.items():
        repeats = _per_repeat(items)
        base = _per_repeat(groups.get((latency, workload, BASELINE), []))
        rates = [_rate(r) for r in repeats.values()]
        drafted = sum(i["drafted"] for i in items)
        rounds = sum(i["rounds"] for i in items)
        compared = [
            i["text_sha1"] == texts[key]
            for i in items
            if (key := (latency, workload, i["request_id"], i["repeat"])) in texts
        ]
        rows.append(
            {
                "latency_ms": latency,
                "workload": workload,
                "config": config,
                "requests": len({i["request_id"] for i in items}),
                "repeats": len(repeats),
                "tok_s": median(rates),
                "tok_s_min": min(rates),
                "tok_s_max": max(rates),
                "wall_s": median([sum(i["wall_s"] for i in r) for r in repeats.values()]),
                "drafted": drafted,
                "accept_rate": sum(i["accepted"] for i in items) / drafted if drafted else None,
                "tokens_per_round": sum(i["emitted"] for i in items) / rounds if rounds else 1.0,
                "speedup": median(rates) / median([_rate(r) for r in base.values()])
                if base
                else None,
                "speedup_paired": median(
                    [_rate(r) / _rate(base[n]) for n, r in repeats.items() if n in base]
                )
                if base
                else None,
                "text_differs": compared.count(False) if compared else None,
            }
        )
    serial_of(rows, groups)
    order = {name: i for i, name in enumerate(dict.fromkeys(r["config"] for r in records))}
    loads = {name: i for i, name in enumerate(dict.fromkeys(r["workload"] for r in records))}
    rows.sort(key=lambda r: (r["latency_ms"], loads[r["workload"]], order[r["config"]]))
    return rows


def serial_of(rows: list[dict[str, Any]], groups: dict[tuple, list[dict[str, Any]]]) -> None:
    """Add ``vs_serial`` (ratio of median tok/s) and ``vs_serial_paired`` (median of
    per-repeat ratios) to every ``X@dN`` row that has an ``X@d1`` row beside it."""
    for row in rows:
        name = row["config"]
        row["vs_serial"] = row["vs_serial_paired"] = None
        if "@d" not in name or name.endswith("@d1"):
            continue
        serial = (row["latency_ms"], row["workload"], name.rsplit("@d", 1)[0] + "@d1")
        if serial not in groups:
            continue
        mine = _per_repeat(groups[(row["latency_ms"], row["workload"], name)])
        base = _per_repeat(groups[serial])
        row["vs_serial"] = row["tok_s"] / median([_rate(r) for r in base.values()])
        row["vs_serial_paired"] = median(
            [_rate(r) / _rate(base[n]) for n, r in mine.items() if n in base]
        )


def table(rows: Sequence[dict[str, Any]]) -> str:
    headers = [
        "latency", "workload", "config", "tok/s", "(min-max)", "wall s",
        "accept", "tok/round", "speedup", "paired", "vs serial", "paired", "text != base",
    ]  # fmt: skip
    body = [
        [
            f"{r['latency_ms']:g} ms",
            r["workload"],
            r["config"],
            fmt(r["tok_s"]),
            f"{fmt(r['tok_s_min'])}-{fmt(r['tok_s_max'])}",
            fmt(r["wall_s"], 1),
            fmt(r["accept_rate"]),
            fmt(r["tokens_per_round"]),
            f"{fmt(r['speedup'])}x" if r["speedup"] is not None else "-",
            f"{fmt(r['speedup_paired'])}x" if r["speedup_paired"] is not None else "-",
            f"{fmt(r['vs_serial'])}x" if r.get("vs_serial") is not None else "-",
            f"{fmt(r['vs_serial_paired'])}x" if r.get("vs_serial_paired") is not None else "-",
            "-" if r["text_differs"] is None else f"{r['text_differs']}",
        ]
        for r in rows
    ]
    return render_table(headers, body)


def write_chart(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Speedup over the baseline: one panel per workload, bars per config and latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    latencies = sorted({r["latency_ms"] for r in rows})
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != BASELINE]
    lookup = {(r["workload"], r["latency_ms"], r["config"]): r for r in rows}
    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for axis, workload in zip(axes[0], workloads, strict=True):
        for index, config in enumerate(configs):
            xs, ys = [], []
            for position, latency in enumerate(latencies):
                row = lookup.get((workload, latency, config))
                if row is not None and row["speedup"] is not None:
                    xs.append(position - 0.4 + width * (index + 0.5))
                    ys.append(row["speedup"])
            bars = axis.bar(xs, ys, width, label=config)
            axis.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        axis.set_xticks(range(len(latencies)), [f"{lat:g} ms/hop" for lat in latencies])
        axis.set_title(f"{workload}: speedup over plain decoding")
        axis.set_ylabel("tok/s relative to baseline")
    axes[0][0].legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- entry point ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "spec_bench")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0])
    parser.add_argument("--workload", nargs="+", default=None, help="workloads (default: all)")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["ngram-fixed", "ngram-adaptive", "ngram-auto", "cost"],
        help="configurations besides the baseline (which always runs)",
    )
    parser.add_argument("--fixed-window", type=int, default=8, help="window of the fixed configs")
    parser.add_argument(
        "--depths",
        nargs="+",
        default=["auto"],
        help="verify windows in flight per request, per configuration: 1 (serial), auto "
        "(the cost rule, up to the default limit) or a limit N; each depth is one mesh",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="override the file's")
    parser.add_argument("--draft-model", default=None, help="draft model for draft-* configs")
    parser.add_argument("--draft-label", default="draft model", help="how tables name the draft")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="merge result files")
    parser.add_argument("--chart", type=Path, default=None, help="write a speedup chart (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args)
    if args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        records = [record for part in parts for record in part["records"]]
        payload = {
            "benchmark": "spec_bench",
            "command": command_line(),
            "parts": [{k: v for k, v in p.items() if k not in ("records", "rows")} for p in parts],
            "rows": summarize(records),
            "records": records,
        }
    else:
        package = resolve_package(args.package)
        workloads = load_workloads(args.workloads or default_workloads_path())
        names = args.workload or list(workloads)
        missing = [n for n in names if n not in workloads]
        if missing:
            raise SystemExit(
                f"no workload {', '.join(missing)}; the file has {', '.join(workloads)}"
            )
        requests = [r for n in names for r in workloads[n]]
        configs = with_depths(
            build_configs(args.configs, args.fixed_window, args.draft_model, args.draft_label),
            args.depths,
        )
        machine = machine_info(args.threads)
        started = time.time()
        records: list[dict[str, Any]] = []
        meshes: dict[str, dict[str, Any]] = {}
        for latency in args.latency_ms:
            part, about = run_latency(package, latency, configs, requests, args)
            records += part
            meshes[f"{latency:g}"] = about
        payload = {
            "benchmark": "spec_bench",
            "command": command_line(),
            "machine": machine,
            "load_average_at_end": load_average(),
            "elapsed_s": round(time.time() - started, 1),
            "package": str(package),
            "configs": {
                c.name: {
                    "label": c.label,
                    "stage0_args": list(c.stage0_args),
                    "coordinator_args": list(c.coordinator_args),
                }
                for c in configs
            },
            "meshes": meshes,
            "max_tokens": args.max_tokens or "from the workload file",
            "rows": summarize(records),
            "records": records,
        }
    emit(table(payload["rows"]))
    write_json(args.out, payload)
    emit(f"wrote {args.out}")
    if args.chart is not None:
        write_chart(payload["rows"], args.chart)
        emit(f"wrote {args.chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
