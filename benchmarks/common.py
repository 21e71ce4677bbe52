"""Shared parts of the mesh benchmarks: local meshes, workloads, metrics scrapes,
single-stage engines (package variants, chat prompts, greedy decoding), machine
description, statistics, tables and JSON output.

The benchmark scripts run from the repository root as plain files
(``.venv/bin/python benchmarks/pipeline_bench.py``), so they import this module as
``common``. Nothing here asserts on timings: scripts report what they measure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKLOADS_ENV = "MESH_BENCH_WORKLOADS"
WORKLOAD_CANDIDATES = (
    REPO_ROOT / "shared" / "bench" / "workloads.jsonl",
    REPO_ROOT.parent / "shared" / "bench" / "workloads.jsonl",
)
MESH_START_DEADLINE_S = 900.0
HTTP_TIMEOUT_S = 600.0


# ---- workloads ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadRequest:
    """One line of workloads.jsonl: an OpenAI chat request of a named workload."""

    workload: str
    request_id: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    # A second turn (multi-turn workloads): this user message follows the model's
    # answer to ``messages``; the benchmark sends both turns, in order, as one tenant.
    follow_up: str | None = None


def default_workloads_path() -> Path:
    """``$MESH_BENCH_WORKLOADS``, or ``shared/bench/workloads.jsonl`` next to the repo."""
    value = os.environ.get(WORKLOADS_ENV)
    if value:
        return Path(value)
    for candidate in WORKLOAD_CANDIDATES:
        if candidate.is_file():
            return candidate
    return WORKLOAD_CANDIDATES[0]


def load_workloads(path: Path) -> dict[str, list[WorkloadRequest]]:
    """Every request of the file, grouped by workload, in file order."""
    if not path.is_file():
        raise FileNotFoundError(
            f"workload file {path} not found; pass --workloads or set ${WORKLOADS_ENV}"
        )
    grouped: dict[str, list[WorkloadRequest]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            request = WorkloadRequest(
                workload=str(body["workload"]),
                request_id=str(body["id"]),
                messages=tuple(dict(m) for m in body["messages"]),
                max_tokens=int(body["max_tokens"]),
                follow_up=str(body["follow_up"]) if body.get("follow_up") else None,
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path}:{number}: not a workload request ({error}); each line needs "
                "workload, id, messages and max_tokens"
            ) from error
        grouped.setdefault(request.workload, []).append(request)
    if not grouped:
        raise ValueError(f"{path} holds no requests")
    return grouped


# ---- local meshes ------------------------------------------------------------------


@dataclass(frozen=True)
class MeshConfig:
    """One local mesh to benchmark: stage count, wire dtype and speculation."""

    stages: int
    wire_dtype: str = "f32"
    speculation: str = "none"
    row_invariant: str = "auto"  # mesh-stage join --row-invariant
    quantised_kernel: str = "auto"  # mesh-stage join --quantised-kernel
    # mesh-stage join --prefix-cache-tokens of stage 0 (None: its default).
    prefix_cache_tokens: int | None = None
    data_transport: str = "tcp"  # mesh-stage join --data-transport
    prompts_ahead: bool = True  # stage 0's --prompts-ahead / --no-prompts-ahead
    inline_frames: bool = True  # mesh-stage join --inline-frames / --no-inline-frames
    decode_stall_ms: float | None = None  # stage 0's --decode-stall-ms (None: its default)

    @property
    def label(self) -> str:
        spec = "" if self.speculation == "none" else f" spec={self.speculation}"
        arithmetic = "" if self.row_invariant == "auto" else f" row-invariant={self.row_invariant}"
        if self.quantised_kernel != "auto":
            arithmetic += f" kernel={self.quantised_kernel}"
        cache = ""
        if self.prefix_cache_tokens is not None:
            cache = f" prefix-cache={self.prefix_cache_tokens or 'off'}"
        if self.data_transport != "tcp":
            cache += f" over {self.data_transport}"
        if not self.prompts_ahead:
            cache += " no-prompts-ahead"
        if not self.inline_frames:
            cache += " frames-on-worker"
        plural = "s" if self.stages > 1 else ""
        return f"{self.stages} stage{plural} {self.wire_dtype}{spec}{arithmetic}{cache}"

    @property
    def setting(self) -> str:
        """The settings a benchmark compares: ``speculation/row-invariant/kernel``,
        ``/grpc`` when frames travel over the gRPC streams, ``/no-prompts-ahead`` when
        new prompts wait for a free frame."""
        over = "" if self.data_transport == "tcp" else f"/{self.data_transport}"
        if not self.prompts_ahead:
            over += "/no-prompts-ahead"
        if not self.inline_frames:
            over += "/frames-on-worker"
        return f"{self.speculation}/{self.row_invariant}/{self.quantised_kernel}{over}"

    def stage_args(self) -> tuple[str, ...]:
        return (
            "--row-invariant",
            self.row_invariant,
            "--quantised-kernel",
            self.quantised_kernel,
            "--data-transport",
            self.data_transport,
            "--inline-frames" if self.inline_frames else "--no-inline-frames",
        )

    def stage0_args(self) -> tuple[str, ...]:
        """``none`` turns speculation off; ``package`` keeps the served default."""
        cache: tuple[str, ...] = ()
        if self.prefix_cache_tokens is not None:
            cache = ("--prefix-cache-tokens", str(self.prefix_cache_tokens))
        if not self.prompts_ahead:
            cache += ("--no-prompts-ahead",)
        if self.decode_stall_ms is not None:
            cache += ("--decode-stall-ms", f"{self.decode_stall_ms:g}")
        if self.speculation == "package":
            return cache
        return ("--spec-type", self.speculation, *cache)


@dataclass(frozen=True)
class RunningMesh:
    config: MeshConfig
    http_url: str
    model_id: str
    processes: Any  # coordinator.localmesh.MeshProcesses
    # Measurements repeated because the pipeline was reloading (503) when they ran.
    interruptions: list[str] = field(default_factory=list)

    def pids(self) -> dict[str, int]:
        """Process ids by role: ``coordinator``, then each stage by its stage index
        (``"0"``, ``"1"`` ...), as the coordinator assigned them, so the keys match
        the ``stage`` label of stage 0's metrics."""
        pids = {"coordinator": self.processes.coordinator.pid}
        index_of = {s.node_id: s.stage_index for s in self.processes.status().stages if s.assigned}
        for node_id, process in self.processes.stages.items():
            key = str(index_of[node_id]) if node_id in index_of else node_id
            pids[key] = process.pid
        return dict(
            sorted(pids.items(), key=lambda item: (item[0] != "coordinator", len(item[0]), item[0]))
        )


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User+system CPU seconds used so far by each process (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for role, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[role] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def runqueue_wait_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Seconds each process's threads spent runnable but waiting for a CPU, so far
    (Linux schedstat, summed over threads; threads that ended are not counted)."""
    waited = {}
    for role, pid in pids.items():
        total = 0
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
        waited[role] = total / 1e9
    return waited


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: after[role] - before[role] for role in after if role in before}


@contextmanager
def running_meshes(
    package: Path,
    configs: Sequence[MeshConfig],
    *,
    threads: int,
    workdir: Path | None = None,
    max_sessions: int = 16,
    heartbeat_timeout_s: float = 0.0,
) -> Iterator[list[RunningMesh]]:
    """Start every mesh at once (their loads overlap), wait until all serve, and
    stop every process on exit, even when a benchmark fails. A positive
    ``heartbeat_timeout_s`` replaces the coordinator's
    default: on a crowded machine a starved process can miss a short one, and the
    coordinator then reloads the pipeline in the middle of a measurement."""
    from coordinator.localmesh import MeshProcesses

    with ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        started = []
        for index, config in enumerate(configs):
            mesh = MeshProcesses(
                package,
                root
                / (
                    f"mesh{index}-{config.stages}st-{config.wire_dtype}-"
                    f"{config.row_invariant}-{config.quantised_kernel}-{config.data_transport}"
                    f"{'' if config.inline_frames else '-worker'}"
                ),
                config.stages,
                wire_dtype=config.wire_dtype,
                threads=threads,
                max_sessions=max_sessions,
                max_queued=max_sessions,
                stage0_args=config.stage0_args(),
                stage_args=config.stage_args(),
                coordinator_args=(
                    ("--heartbeat-timeout", str(heartbeat_timeout_s))
                    if heartbeat_timeout_s > 0
                    else ()
                ),
            )
            stack.callback(mesh.close)
            started.append((config, mesh.start()))
        meshes = []
        for config, mesh in started:
            body = mesh.wait_serving(deadline_s=MESH_START_DEADLINE_S)
            logger.info("%s serving at %s", config.label, mesh.http_url)
            meshes.append(RunningMesh(config, mesh.http_url, body["model_id"], mesh))
        yield meshes


def is_unavailable(error: BaseException) -> bool:
    """A 503 from the frontend (the pipeline is reloading) or a refused connection."""
    import openai

    if isinstance(error, openai.APIStatusError):
        return error.status_code == 503
    return isinstance(error, openai.APIConnectionError)


def wait_ready(http_url: str, deadline_s: float = MESH_START_DEADLINE_S) -> None:
    """Poll ``/health`` until the frontend answers 200."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(http_url + "/health", timeout=10) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"{http_url} did not become ready within {deadline_s:.0f}s")
        time.sleep(0.5)


def with_recovery(mesh: RunningMesh, what: str, measure: Callable[[], T], attempts: int = 3) -> T:
    """Run ``measure``; when the pipeline was unavailable, wait until it serves again
    and measure again (the interrupted attempt is discarded and noted on ``mesh``)."""
    attempt = 1
    while True:
        try:
            return measure()
        except Exception as error:
            if not is_unavailable(error) or attempt >= attempts:
                raise
            mesh.interruptions.append(f"{what}: {error}")
            logger.warning("%s: %s; waiting for the pipeline and measuring again", what, error)
        wait_ready(mesh.http_url)
        attempt += 1


def openai_client(http_url: str):
    from openai import OpenAI

    return OpenAI(
        base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


# ---- the frontend's Prometheus metrics -----------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_histogram_totals(
    text: str, name: str, scale: float = 1.0
) -> dict[str, tuple[float, float]]:
    """``{label_string: (sum * scale, count)}`` of histogram ``name`` in Prometheus
    text (``scale=1000`` reads a ``_seconds`` histogram's sums in ms)."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        metric, labels, value = match.groups()
        labels = labels or ""
        if metric == f"{name}_sum":
            totals.setdefault(labels, [0.0, 0.0])[0] = float(value) * scale
        elif metric == f"{name}_count":
            totals.setdefault(labels, [0.0, 0.0])[1] = float(value)
    return {labels: (pair[0], pair[1]) for labels, pair in totals.items()}


def histogram_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean of the observations made between two scrapes, per label string."""
    means: dict[str, float] = {}
    for labels, (total, count) in after.items():
        old_total, old_count = before.get(labels, (0.0, 0.0))
        if count > old_count:
            means[labels] = (total - old_total) / (count - old_count)
    return means


def histogram_sums(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Sum of the observations made between two scrapes, per label string."""
    return {
        labels: total - before.get(labels, (0.0, 0.0))[0] for labels, (total, _) in after.items()
    }


def label_value(labels: str, key: str) -> str | None:
    """``label_value('{stage="1"}', "stage") == "1"``."""
    match = re.search(rf'{key}="([^"]*)"', labels)
    return match.group(1) if match else None


@dataclass(frozen=True)
class PipelineMetrics:
    """One scrape of stage 0's round and per-stage compute histograms (sums in ms)."""

    round_ms: dict[str, tuple[float, float]]
    stage_compute_ms: dict[str, tuple[float, float]]


def scrape_pipeline_metrics(http_url: str) -> PipelineMetrics:
    with urllib.request.urlopen(http_url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return PipelineMetrics(
        round_ms=parse_histogram_totals(text, "mesh_pipeline_round_seconds", 1000.0),
        stage_compute_ms=parse_histogram_totals(text, "mesh_stage_compute_seconds", 1000.0),
    )


def by_label(values: dict[str, float], key: str) -> dict[str, float]:
    """Re-key ``{'{stage="0"}': x}`` as ``{"0": x}``."""
    out = {}
    for labels, value in values.items():
        name = label_value(labels, key)
        if name is not None:
            out[name] = value
    return dict(sorted(out.items()))


# ---- statistics ----------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """Median, or NaN for no values."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of ``values`` (JSON-friendly)."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {
        "median": statistics.median(finite),
        "min": min(finite),
        "max": max(finite),
        "n": len(finite),
    }


def ratio(numerator: float, denominator: float) -> float:
    if denominator == 0 or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def rotated(items: Sequence[Any], offset: int) -> list[Any]:
    """``items`` starting at ``offset``: repeats visit configurations in shifted order,
    so no configuration always runs first (or right after a heavy one)."""
    if not items:
        return []
    shift = offset % len(items)
    return list(items[shift:]) + list(items[:shift])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    try:
        from importlib.metadata import version

        grpc_version = version("grpcio")
    except Exception:  # noqa: BLE001 - the version is informative only
        grpc_version = "unknown"
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "stage_device": os.environ.get("MESH_STAGE_DEVICE", "cpu"),
        "cuda_graphs": os.environ.get("MESH_STAGE_CUDA_GRAPHS", "false"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc_version,
        "torch_threads_per_stage": threads,
        "load_average_at_start": load_average(),
    }


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (it reads in a terminal and pastes into docs)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_json_safe(payload), indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def _json_safe(value: Any) -> Any:
    """NaN/inf become null: strict JSON readers refuse them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--package",
        type=Path,
        default=None,
        help="model package directory (default: the SmolLM2-135M-Instruct package, "
        "built under $MESH_HOME on first use)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads of every stage process"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured repeats (>= 1)")
    parser.add_argument(
        "--workloads", type=Path, default=None, help="workloads.jsonl (default: shared/bench)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results") / f"{name}.json", help="JSON output"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep mesh logs here")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="coordinator heartbeat timeout in seconds (0: its default); generous, so a "
        "starved process on a busy machine does not trigger a reload mid-measurement",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="torch device of every stage process, e.g. cuda:0 (default: the stages' own "
        "setting, cpu unless MESH_STAGE_DEVICE says otherwise)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the stages replay decode steps as CUDA graphs (with a CUDA --device)",
    )
    parser.add_argument("--log-level", default="WARNING")


def resolve_package(package: Path | None) -> Path:
    if package is not None:
        return package.resolve()
    from mesh.package.default import build_default_package

    return build_default_package()


def configure(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.threads < 1:
        raise SystemExit("--threads must be at least 1: a fair comparison fixes the count")
    # Every stage process a benchmark starts inherits this environment (the stages'
    # own settings tree reads it), so each benchmark's meshes follow these two options.
    if getattr(args, "device", None):
        os.environ["MESH_STAGE_DEVICE"] = args.device
    if getattr(args, "cuda_graphs", False):
        os.environ["MESH_STAGE_CUDA_GRAPHS"] = "true"


def emit(text: str) -> None:
    """Write a result block to stdout (benchmarks are CLI entry points)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
