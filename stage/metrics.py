"""A stage process's Prometheus series: its links, the frames it runs, its sessions
and KV cache, its term and loads.

Frames, links and loads are counted as they happen (the frame worker, the link
threads, the gRPC servicers); the node's state (term, sessions, KV bytes) is read
when a scrape asks for it. Stage 0's frontend and engine core add their own series
to the same registry (stage/frontend/telemetry.py, engine_metrics.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mesh.errors import MeshError
from mesh.frames import Frame, SegmentKind
from mesh.metrics import QUEUE_BUCKETS_S, SEGMENT_BUCKETS, STEP_BUCKETS_S, TOKEN_BUCKETS

if TYPE_CHECKING:
    from stage.node import LoadedStage, StageNode

# The links of a stage: ``forward`` carries frames to the next stage (and into this
# one from the previous), ``return`` carries results from the last stage to stage 0.
LINKS = ("forward", "return")


class LinkTraffic:
    """Frames and bytes of one link in one direction."""

    def __init__(self, frames: Counter, nbytes: Counter, link: str) -> None:
        self._frames = frames.labels(link=link)
        self._bytes = nbytes.labels(link=link)

    def count(self, nbytes: int) -> None:
        self._frames.inc()
        self._bytes.inc(nbytes)


class StageMetrics:
    """The series of one stage process, in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        frames_sent = Counter(
            "mesh_link_frames_sent_total",
            "Messages this stage sent on a link: frames downstream (forward), results "
            "to stage 0 (return).",
            ("link",),
            registry=r,
        )
        bytes_sent = Counter(
            "mesh_link_bytes_sent_total",
            "Serialized bytes of the messages this stage sent on a link.",
            ("link",),
            registry=r,
        )
        frames_received = Counter(
            "mesh_link_frames_received_total",
            "Messages this stage received on a link: frames from upstream (forward), "
            "results from the last stage (return, stage 0 only).",
            ("link",),
            registry=r,
        )
        bytes_received = Counter(
            "mesh_link_bytes_received_total",
            "Serialized bytes of the messages this stage received on a link.",
            ("link",),
            registry=r,
        )
        self.sent = {link: LinkTraffic(frames_sent, bytes_sent, link) for link in LINKS}
        self.received = {link: LinkTraffic(frames_received, bytes_received, link) for link in LINKS}
        self.queue_seconds = Histogram(
            "mesh_frame_queue_seconds",
            "Time a frame waited on this stage before its compute started.",
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "mesh_frame_compute_seconds",
            "Time this stage spent running a frame (its layers, and sampling on the last stage).",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.frame_segments = Histogram(
            "mesh_frame_segments",
            "Segments (sessions) per frame this stage ran.",
            buckets=SEGMENT_BUCKETS,
            registry=r,
        )
        self.frame_tokens = Histogram(
            "mesh_frame_tokens",
            "Tokens (activation rows) per frame this stage ran.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        segments = Counter(
            "mesh_stage_segments_total",
            "Segments this stage ran, by kind (prefill, decode, verify, end).",
            ("kind",),
            registry=r,
        )
        self._segments = {kind: segments.labels(kind=kind.value) for kind in SegmentKind}
        self.frame_errors = Counter(
            "mesh_stage_frame_errors_total",
            "Frames that failed on this stage, by gRPC code (FAILED_PRECONDITION: a frame "
            "of another term, dropped; UNAVAILABLE: no layers loaded).",
            ("code",),
            registry=r,
        )
        self.loads = Counter(
            "mesh_stage_loads_total", "Layer ranges this stage loaded (one per term).", registry=r
        )
        self.load_failures = Counter(
            "mesh_stage_load_failures_total", "Load calls this stage refused or failed.", registry=r
        )
        self.link_breaks = Counter(
            "mesh_link_breaks_total",
            "Times an outgoing data link of this stage broke (forward: to the next stage; "
            "return: to stage 0).",
            ("link",),
            registry=r,
        )
        self.links_reopened = Counter(
            "mesh_link_reopened_total",
            "Times this stage opened a broken data link again on the same term itself "
            "(while the coordinator could not be reached).",
            ("link",),
            registry=r,
        )
        self.releases = Counter(
            "mesh_stage_releases_total",
            "Times this stage dropped its layers (released, fenced by a newer term, stopping).",
            registry=r,
        )

    def watch(self, node: StageNode) -> None:
        """Read ``node``'s state at every scrape, and count its loads and releases."""
        self.registry.register(_NodeCollector(node))
        node.on_load_change(self._on_load_change)

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        (self.loads if loaded is not None else self.releases).inc()

    def frame_done(self, frame: Frame, queued_s: float, compute_s: float) -> None:
        """A frame ran here after waiting ``queued_s`` and computing for ``compute_s``."""
        self.queue_seconds.observe(queued_s)
        self.compute_seconds.observe(compute_s)
        self.frame_segments.observe(len(frame.segments))
        self.frame_tokens.observe(frame.row_count)
        for segment in frame.segments:
            self._segments[segment.kind].inc()

    def frame_failed(self, error: BaseException) -> None:
        code = error.grpc_code if isinstance(error, MeshError) else "INTERNAL"
        self.frame_errors.labels(code=code).inc()


class _NodeCollector(Collector):
    """The node's state, read when scraped."""

    def __init__(self, node: StageNode) -> None:
        self._node = node

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        term, loaded_flag, index, layers, sessions, limit, kv, prefix, info, dropped, graphs = (
            families
        )
        node = self._node
        settings = node.settings
        info.add_metric([settings.node_id, settings.device], 1)
        term.add_metric([], node.term)
        loaded = node.loaded
        runtime = loaded.engine.runtime if loaded is not None else None
        loaded_flag.add_metric([], 1 if loaded is not None else 0)
        index.add_metric([], loaded.request.stage_index if loaded is not None else -1)
        if loaded is not None:
            span = loaded.request.layer_range
            layers.add_metric([], span.end - span.start)
        else:
            layers.add_metric([], 0)
        # Never waits for a step (a scrape during a long prompt chunk would).
        stats = runtime.stats() if runtime is not None else None
        sessions.add_metric([], stats.sessions if stats is not None else 0)
        limit.add_metric([], runtime.max_sessions if runtime is not None else 0)
        kv.add_metric([], stats.kv_bytes if stats is not None else 0)
        prefix.add_metric([], stats.prefix_bytes if stats is not None else 0)
        dropped.add_metric([], loaded.engine.dropped_segments if loaded is not None else 0)
        replayed = runtime.graph_frames if runtime is not None else {"session": 0, "bucket": 0}
        for path, count in replayed.items():
            graphs.add_metric([path], count)
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("mesh_stage_term", "The term this stage accepted last."),
            GaugeMetricFamily("mesh_stage_loaded", "1 while this stage holds layers, else 0."),
            GaugeMetricFamily(
                "mesh_stage_index", "This stage's place in the pipeline (-1: nothing loaded)."
            ),
            GaugeMetricFamily("mesh_stage_layers", "Decoder layers this stage holds."),
            GaugeMetricFamily("mesh_stage_sessions", "Sessions this stage holds KV for."),
            GaugeMetricFamily(
                "mesh_stage_session_limit", "The most sessions this stage may hold (its Load)."
            ),
            GaugeMetricFamily(
                "mesh_stage_kv_bytes", "Bytes of KV cache allocated to this stage's sessions."
            ),
            GaugeMetricFamily(
                "mesh_stage_prefix_kv_bytes",
                "Bytes of KV cache held for kept prefixes (the prefix cache).",
            ),
            GaugeMetricFamily(
                "mesh_stage_info", "This stage's node id and device.", labels=("node_id", "device")
            ),
            GaugeMetricFamily(
                "mesh_stage_dropped_ahead_segments",
                "Windows drafted ahead that this (last) stage dropped unrun since its load: "
                "a verdict had refuted them.",
            ),
            GaugeMetricFamily(
                "mesh_stage_graph_frames",
                "Frames this stage ran through its CUDA graph steps since its load (--cuda-graphs; "
                "path: session = one session's decode token, bucket = a frame of up to 32 rows).",
                labels=("path",),
            ),
        ]
