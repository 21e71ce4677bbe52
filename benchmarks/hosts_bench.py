"""Decode speed across hosts, with the performance model's prediction beside each
measured figure (docs/performance.md).

Hosts are network namespaces (coordinator.netns_hosts): a head (coordinator, stage
0, HTTP) and a worker on a bridge, each with its own 10.x address, started with the
README's commands. For each package (float32 and int4 SmolLM2 by default), in one
run:

- one process (1 stage) and 2 stages on loopback (MeshProcesses);
- 2 stages across the namespaces at 0, 5, 20, 50 ms injected per hop
  (``--inject-delay-ms`` on every stage), and at 0 ms under ``tc tbf`` limits of
  1 Gbit/s and 100 Mbit/s on both hosts' links;
- the slice transfer: a worker that cannot read the package fetches its slice from
  the head through a 100 Mbit/s link; its rate against the link's.

Each figure is the median over ``--repeats`` greedy chat completions (speculation off,
one request at a time) of the server's decode tok/s. The model predicts a token's
time as the sum of the stages' measured compute per decode step, plus the hops
times (the per-hop overhead fitted once on the 2-stage loopback mesh + the injected
delay), plus the activation bytes over the bandwidth at each boundary.

    .venv/bin/python benchmarks/hosts_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    command_line,
    default_workloads_path,
    emit,
    fmt,
    label_value,
    load_workloads,
    machine_info,
    median,
    render_table,
    scrape_pipeline_metrics,
    write_json,
)

sys.path.insert(0, str(REPO_ROOT))

from coordinator.localmesh import MeshProcesses, wait_for  # noqa: E402
from coordinator.netns_hosts import NetnsHosts, rate_bits, unavailable_reason  # noqa: E402
from mesh.codec import bytes_per_token  # noqa: E402
from mesh.package.manifest import PackageManifest  # noqa: E402

logger = logging.getLogger("hosts_bench")
BIN = Path(sys.executable).parent
DELAYS_MS = (0.0, 5.0, 20.0, 50.0)
RATES = ("1gbit", "100mbit")
# Protobuf and gRPC framing around one decode frame's activations, in bytes (the
# encoded frame measured by pipeline_bench is within this of the payload).
FRAME_OVERHEAD_BYTES = 200


# ---- the model -----------------------------------------------------------------------


def hops(stages: int) -> int:
    """Network hops per decode step: N-1 Forward hops and the Return hop; none for 1."""
    return stages if stages > 1 else 0


def predict_tok_s(
    stage_ms: list[float],
    step_overhead_ms: float,
    hop_overhead_ms: float,
    delay_ms: float,
    bytes_per_boundary: int,
    rate_bits: float | None,
) -> float:
    """tok/s = 1000 / (stage 0's per-step overhead + sum of compute
    + hops x (hop overhead + delay) + boundaries x bytes / bandwidth)."""
    stages = len(stage_ms)
    wire_ms = 0.0
    if rate_bits:
        wire_ms = (bytes_per_boundary + FRAME_OVERHEAD_BYTES) * 8 / rate_bits * 1000.0
    total = step_overhead_ms + sum(stage_ms) + hops(stages) * (hop_overhead_ms + delay_ms)
    total += (stages - 1) * wire_ms
    return 1000.0 / total


def _rate_bits(rate: str | None) -> float | None:
    return None if rate is None else float(rate_bits(rate))


# ---- measuring -----------------------------------------------------------------------


def _chat(url: str, model: str, messages, max_tokens: int):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=600)
    return client.chat.completions.create(
        model=model, messages=list(messages), max_tokens=max_tokens, temperature=0
    )


def _compute_sums(url: str) -> dict[str, tuple[float, float]]:
    scrape = scrape_pipeline_metrics(url)
    return {
        label_value(labels, "stage") or labels: pair
        for labels, pair in scrape.stage_compute_ms.items()
    }


def decode_once(url: str, model: str, messages, max_tokens: int) -> dict[str, Any]:
    """Decode tok/s of one request and each stage's compute per decode step. A
    one-token request with the same prompt first measures each stage's prefill
    compute, which is taken out of the measured request's totals."""
    probe = _compute_sums(url)
    _chat(url, model, messages, 1)
    before = _compute_sums(url)
    prefill = {s: total - probe.get(s, (0.0, 0.0))[0] for s, (total, _) in before.items()}
    reply = _chat(url, model, messages, max_tokens)
    after = _compute_sums(url)
    timings = (reply.model_extra or {}).get("timings") or {}
    stage_ms = {}
    for stage, (total, count) in after.items():
        old_total, old_count = before.get(stage, (0.0, 0.0))
        frames = count - old_count - 1
        if frames > 0:
            stage_ms[stage] = (total - old_total - prefill.get(stage, 0.0)) / frames
    return {
        "tok_s": timings.get("predicted_per_second"),
        "tokens": reply.usage.completion_tokens,
        "stage_ms": dict(sorted(stage_ms.items())),
    }


def measure_alternating(
    urls: list[str], model: str, messages, max_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    """Warm every mesh up, then ``repeats`` rounds that visit every mesh (in a shifted
    order each round), so a drift of the machine's speed hits all of them alike."""
    for url in urls:
        _chat(url, model, messages, max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {url: [] for url in urls}
    for repeat in range(repeats):
        shift = repeat % len(urls)
        for url in urls[shift:] + urls[:shift]:
            runs[url].append(decode_once(url, model, messages, max_tokens))
    results = []
    for url in urls:
        mine = runs[url]
        stages = sorted(mine[0]["stage_ms"], key=int)
        results.append(
            {
                "tok_s": median([r["tok_s"] for r in mine]),
                "stage_ms": [median([r["stage_ms"][s] for r in mine]) for s in stages],
                "runs": mine,
            }
        )
    return results


def measure(url: str, model: str, messages, max_tokens: int, repeats: int) -> dict[str, Any]:
    return measure_alternating([url], model, messages, max_tokens, repeats)[0]


# ---- meshes ------------------------------------------------------------------------------


class NamespaceMesh:
    """The README recipe on namespace hosts: `up` on the head, `join` on the worker."""

    def __init__(
        self,
        hosts: NetnsHosts,
        package: Path,
        workdir: Path,
        delay_ms: float = 0.0,
        hide_package: bool = False,
    ) -> None:
        self.hosts = hosts
        self.head_ip = hosts.address("head")
        delay = ["--inject-delay-ms", f"{delay_ms:g}"] if delay_ms else []
        up = [str(BIN / "mesh-coordinator"), "up", "--model", str(package), "--min-stages", "2",
              "--listen", "0.0.0.0:7070", "--http-host", "0.0.0.0", "--http-port", "8000",
              "--stage-threads", "1", "--spec-type", "none", "--heartbeat-timeout", "30",
              *delay]  # fmt: skip
        join = [str(BIN / "mesh-stage"), "join", "--coordinator", f"{self.head_ip}:7070",
                "--threads", "1", *delay]  # fmt: skip
        if hide_package:
            hide = f"mount -t tmpfs tmpfs {shlex.quote(str(package.parent))}"
            join = ["unshare", "-m", "sh", "-c", f"{hide} && exec {shlex.join(join)}"]
        self.processes = [
            hosts.popen("head", up, workdir / "head.log", _home(workdir / "head")),
            hosts.popen("worker", join, workdir / "worker.log", _home(workdir / "worker")),
        ]
        self.url = f"http://{self.head_ip}:8000"

    def status(self):
        from coordinator.cli import fetch_status
        from mesh.errors import MeshError

        try:
            return fetch_status(f"{self.head_ip}:7070")
        except MeshError:
            return None

    def wait_serving(self):
        def serving():
            status = self.status()
            return status if status is not None and status.state == "serving" else None

        return wait_for(serving, 900, "the namespace mesh to serve")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _home(path: Path) -> dict[str, str]:
    return {"MESH_HOME": str(path / "home"), "PYTHONUNBUFFERED": "1"}


def loopback(package: Path, stages: int, workdir: Path) -> MeshProcesses:
    mesh = MeshProcesses(
        package, workdir, stages, threads=1, stage0_args=("--spec-type", "none"),
        coordinator_args=("--heartbeat-timeout", "30"),
    )  # fmt: skip
    mesh.start().wait_serving(deadline_s=900)
    return mesh


# ---- the run -------------------------------------------------------------------------------


def bench_package(
    package: Path, hosts: NetnsHosts, workdir: Path, messages, args: argparse.Namespace
) -> list[dict[str, Any]]:
    model = PackageManifest.load(package).model_id
    label_name = package.name  # float32 and int4 builds share a model id
    config = json.loads((package / "config.json").read_text())
    boundary_bytes = bytes_per_token(int(config["hidden_size"]), "f32")
    rows: list[dict[str, Any]] = []

    def record(label: str, stages: int, delay: float, rate: str | None, result: dict) -> None:
        rows.append(
            {"package": label_name, "config": label, "stages": stages, "delay_ms": delay,
             "rate": rate, **result}
        )  # fmt: skip
        emit(f"{label_name} {label}: {result['tok_s']:.2f} tok/s")

    mesh = loopback(package, 1, workdir / f"{label_name}-loop1")
    try:
        record("loopback, 1 stage(s)", 1, 0.0, None, measure(mesh.http_url, model, messages,
               args.tokens, args.repeats))  # fmt: skip
    finally:
        mesh.close()
    # The 2-stage loopback mesh and the 2-stage namespace mesh at 0 ms run side by
    # side and are measured in alternation: their ratio is the across-hosts goal.
    loop2 = loopback(package, 2, workdir / f"{label_name}-loop2")
    ns0 = NamespaceMesh(hosts, package, workdir / f"{label_name}-ns-0ms")
    try:
        ns0.wait_serving()
        pair = measure_alternating(
            [loop2.http_url, ns0.url], model, messages, args.tokens, args.repeats
        )
    finally:
        loop2.close()
        ns0.close()
    record("loopback, 2 stage(s)", 2, 0.0, None, pair[0])
    # The two constants of the model, fitted on loopback: stage 0's own cost per step
    # (1 stage), then the cost of one hop (2 stages).
    one, two = rows[-2], rows[-1]
    step_overhead_ms = max(0.0, 1000.0 / one["tok_s"] - sum(one["stage_ms"]))
    hop_overhead_ms = (1000.0 / two["tok_s"] - sum(two["stage_ms"]) - step_overhead_ms) / hops(2)
    record("namespaces, 0 ms/hop", 2, 0.0, None, pair[1])
    for delay in args.delays:
        if delay == 0.0 and not args.rates:
            continue  # measured above
        mesh = NamespaceMesh(hosts, package, workdir / f"{label_name}-ns-{delay:g}ms-b", delay)
        try:
            mesh.wait_serving()
            if delay != 0.0:
                result = measure(mesh.url, model, messages, args.tokens, args.repeats)
                record(f"namespaces, {delay:g} ms/hop", 2, delay, None, result)
            else:
                for rate in args.rates:
                    for host in ("head", "worker"):
                        hosts.limit_rate(host, rate)
                    result = measure(mesh.url, model, messages, args.tokens, args.repeats)
                    record(f"namespaces, {rate}", 2, 0.0, rate, result)
                for host in ("head", "worker"):
                    hosts.limit_rate(host, None)
        finally:
            mesh.close()
    for row in rows:
        predicted = predict_tok_s(
            row["stage_ms"], step_overhead_ms, hop_overhead_ms, row["delay_ms"], boundary_bytes,
            _rate_bits(row["rate"]),
        )  # fmt: skip
        row["predicted_tok_s"] = predicted
        row["error"] = row["tok_s"] / predicted - 1.0
        row["hop_overhead_ms"] = hop_overhead_ms
        row["step_overhead_ms"] = step_overhead_ms
    return rows


def bench_slice_transfer(package: Path, hosts: NetnsHosts, workdir: Path, rate: str) -> dict:
    """Seconds for a worker that cannot read the package to fetch its slice from the
    head through ``rate`` links, and the rate achieved against the link's."""
    for host in ("head", "worker"):
        hosts.limit_rate(host, rate)
    mesh = NamespaceMesh(hosts, package, workdir / "slice", hide_package=True)
    try:
        status = mesh.wait_serving()
        worker = next(s for s in status.stages if s.address.startswith(hosts.address("worker")))
        # The worker logs when it starts fetching from the head and when the slice is
        # ready; the rate is the slice's bytes over that time.
        log = (workdir / "slice" / "worker.log").read_text()
        started = _log_time(log, "fetching slice")
        done = _log_time(log, "ready at")
        seconds = done - started
        total = worker.slice_bytes_total
        link = _rate_bits(rate) / 8
        return {
            "rate": rate,
            "bytes": total,
            "seconds": round(seconds, 3),
            "bytes_per_s": total / seconds,
            "fraction_of_link": total / seconds / link,
        }
    finally:
        mesh.close()
        for host in ("head", "worker"):
            hosts.limit_rate(host, None)


def _log_time(log: str, marker: str) -> float:
    """Seconds (of the day) of the first log line containing ``marker``."""
    import datetime as dt

    for line in log.splitlines():
        if marker in line:
            stamp = dt.datetime.strptime(" ".join(line.split()[:2]), "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise RuntimeError(f"no log line with {marker!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--package",
        type=Path,
        action="append",
        default=None,
        help="package directory (repeat); default: SmolLM2 float32 and int4",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--delays", type=float, nargs="+", default=list(DELAYS_MS))
    parser.add_argument("--rates", nargs="*", default=list(RATES))
    parser.add_argument("--slice-rate", default="100mbit", help="'' to skip the transfer")
    parser.add_argument("--workloads", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "hosts.json")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"hosts_bench needs network namespaces: {reason}")
    from mesh.package.default import build_default_package

    packages = args.package or [build_default_package(), build_default_package(quant="int4")]
    workloads = load_workloads(args.workloads or default_workloads_path())
    messages = workloads["chat"][0].messages
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mesh-hosts-"))
    hosts = NetnsHosts(["head", "worker"]).create()
    hosts.reach_from_test_process()
    try:
        rows = []
        for package in packages:
            rows += bench_package(Path(package).resolve(), hosts, workdir, messages, args)
        transfer = None
        if args.slice_rate:
            transfer = bench_slice_transfer(
                Path(packages[0]).resolve(), hosts, workdir, args.slice_rate
            )
    finally:
        hosts.close()
    table = render_table(
        ["package", "configuration", "stage compute ms", "measured tok/s", "model tok/s", "error"],
        [
            [r["package"], r["config"], " + ".join(fmt(c) for c in r["stage_ms"]),
             fmt(r["tok_s"]), fmt(r["predicted_tok_s"]), f"{100 * r['error']:+.1f}%"]
            for r in rows
        ],
    )  # fmt: skip
    emit(table)
    for model in dict.fromkeys(r["package"] for r in rows):
        mine = [r for r in rows if r["package"] == model]
        loop2 = next(r for r in mine if r["config"].startswith("loopback, 2"))
        ns0 = next(r for r in mine if r["config"] == "namespaces, 0 ms/hop")
        emit(
            f"{model}: namespaces / loopback at 2 stages = {ns0['tok_s'] / loop2['tok_s']:.3f}; "
            f"per-hop overhead fitted on loopback {mine[0]['hop_overhead_ms']:.2f} ms; "
            f"largest model error {max(abs(r['error']) for r in mine) * 100:.1f}%"
        )
    if transfer is not None:
        emit(
            f"slice transfer through {transfer['rate']}: {transfer['bytes']} bytes in "
            f"{transfer['seconds']} s = {transfer['fraction_of_link']:.2f} of the link"
        )
    write_json(
        args.out,
        {
            "command": command_line(),
            "machine": machine_info(1),
            "rows": rows,
            "slice_transfer": transfer,
        },
    )
    emit(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
