"""Stage 0's engine series: the frames it sends, the pipeline as stage 0 sees it
(round time, each stage's compute and queue time from the results' timings), stale
results, speculation counters, and the engine core's state.

Events are counted when they happen, on the scheduler's event loop; the engine
core's state (requests running and queued, recoveries, the prefix cache, the fitted
step cost) is read when a scrape asks for it. Speculation is counted per decode
round as results commit, so a request that ends on a stop string, at a client
disconnect or with an error counts every round it made.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mesh.frames import Frame, FrameResult, Segment
from mesh.metrics import (
    LATENCY_BUCKETS_S,
    QUEUE_BUCKETS_S,
    SEGMENT_BUCKETS,
    STEP_BUCKETS_S,
    TOKEN_BUCKETS,
)
from mesh.speculative import CompositeDrafter, Telemetry
from stage.frontend import ahead
from stage.frontend.engine_types import SentFrame
from stage.frontend.request_run import RequestRun

if TYPE_CHECKING:
    from stage.frontend.scheduler import PipelineScheduler

STALE_REASONS = ("term", "epoch", "position", "count", "unclaimed")


class EngineMetrics:
    """The engine's series in ``registry`` (the stage-0 process's)."""

    def __init__(self, registry: CollectorRegistry, scheduler: PipelineScheduler) -> None:
        r = registry
        self._segments = Counter(
            "mesh_pipeline_rounds_total",
            "Segments stage 0 sent through the pipeline, by kind.",
            ("kind",),
            registry=r,
        )
        self._step_segments = Histogram(
            "mesh_step_segments",
            "Segments (sessions) per frame stage 0 sends.",
            buckets=SEGMENT_BUCKETS,
            registry=r,
        )
        self._step_tokens = Histogram(
            "mesh_step_tokens",
            "Tokens (activation rows) per frame stage 0 sends.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self._stage_compute = Histogram(
            "mesh_stage_compute_seconds",
            "Compute time per frame on each stage of the pipeline, by stage index (from "
            "the timings each result carries back to stage 0).",
            ("stage",),
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self._stage_queue = Histogram(
            "mesh_stage_queue_seconds",
            "Time a frame waited on each stage before its compute started, by stage index.",
            ("stage",),
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        self._round = Histogram(
            "mesh_pipeline_round_seconds",
            "Time from sending a frame to receiving its answer, by the kind of its "
            "segments (mixed when they differ).",
            ("kind",),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._stale = Counter(
            "mesh_stale_results_total",
            "Results and errors dropped because they answer no segment in flight: of an "
            "older term (term) or epoch (epoch), another position (position), too many "
            "tokens (count), or for a request no longer waiting (unclaimed).",
            ("reason",),
            registry=r,
        )
        for reason in STALE_REASONS:
            self._stale.labels(reason=reason)
        by_drafter = ("strategy", "drafter")
        self._drafted = Counter(
            "mesh_speculation_drafted_tokens_total",
            "Draft tokens proposed, by strategy and the drafter that proposed them (a "
            "composite strategy's child: ngram, draft-model).",
            by_drafter,
            registry=r,
        )
        self._accepted = Counter(
            "mesh_speculation_accepted_tokens_total",
            "Draft tokens the last stage accepted, by strategy and drafter.",
            by_drafter,
            registry=r,
        )
        self._windows = Counter(
            "mesh_speculation_windows_total",
            "Decode rounds that carried draft tokens (verify windows), by strategy and drafter.",
            by_drafter,
            registry=r,
        )
        self._draft_seconds = Counter(
            "mesh_speculation_draft_seconds_total",
            "Time spent proposing draft tokens, by strategy and drafter.",
            by_drafter,
            registry=r,
        )
        self._rounds = Counter(
            "mesh_speculation_rounds_total",
            "Decode rounds of requests that speculate, with or without drafts, by strategy.",
            ("strategy",),
            registry=r,
        )
        self._emitted = Counter(
            "mesh_speculation_emitted_tokens_total",
            "Tokens those decode rounds committed, by strategy.",
            ("strategy",),
            registry=r,
        )
        # What was counted of each running request's telemetry so far.
        self._counted: weakref.WeakKeyDictionary[RequestRun, Telemetry] = (
            weakref.WeakKeyDictionary()
        )
        registry.register(_EngineCollector(scheduler))

    def frame_sent(self, frame: Frame) -> None:
        for segment in frame.segments:
            self._segments.labels(kind=segment.kind.value).inc()
        self._step_segments.observe(len(frame.segments))
        self._step_tokens.observe(frame.row_count)

    def segments_joined(self, segments: Sequence[Segment]) -> None:
        """New prompts added to a frame already sent (not yet started by stage 0): the
        segment counts include them; the step histograms keep the frame as sent."""
        for segment in segments:
            self._segments.labels(kind=segment.kind.value).inc()

    def result_received(self, sent: SentFrame | None, result: FrameResult) -> None:
        """The round time and each stage's timings of a result of the current term."""
        if sent is None or sent.term != result.term or not result.timings:
            return
        kinds = {kind.value for kind in sent.kinds.values()}
        label = kinds.pop() if len(kinds) == 1 else "mixed"
        self._round.labels(kind=label).observe(time.perf_counter() - sent.sent_at)
        for timing in result.timings:
            stage = str(timing.stage_index)
            self._stage_compute.labels(stage=stage).observe(timing.compute_ms / 1000.0)
            self._stage_queue.labels(stage=stage).observe(timing.queue_ms / 1000.0)

    def stale(self, reasons: list[str]) -> None:
        for reason in reasons:
            self._stale.labels(reason=reason).inc()

    def rounds(self, run: RequestRun) -> Telemetry | None:
        """Count the decode rounds ``run`` made since the last call; return them (None
        when it made none, or does not speculate)."""
        telemetry = run.telemetry
        if telemetry is None or not run.strategy:
            return None
        before = self._counted.get(run, Telemetry())
        if telemetry.rounds == before.rounds:
            return None
        delta = Telemetry(
            drafted=telemetry.drafted - before.drafted,
            accepted=telemetry.accepted - before.accepted,
            windows=telemetry.windows - before.windows,
            rounds=telemetry.rounds - before.rounds,
            emitted=telemetry.emitted - before.emitted,
            draft_time_s=telemetry.draft_time_s - before.draft_time_s,
            round_time_s=telemetry.round_time_s - before.round_time_s,
        )
        self._counted[run] = before + delta
        strategy = run.strategy
        self._rounds.labels(strategy=strategy).inc(delta.rounds)
        self._emitted.labels(strategy=strategy).inc(delta.emitted)
        if delta.windows:
            drafter = _proposer(run)
            self._windows.labels(strategy=strategy, drafter=drafter).inc(delta.windows)
            self._drafted.labels(strategy=strategy, drafter=drafter).inc(delta.drafted)
            self._accepted.labels(strategy=strategy, drafter=drafter).inc(delta.accepted)
            self._draft_seconds.labels(strategy=strategy, drafter=drafter).inc(
                max(0.0, delta.draft_time_s)
            )
        return delta


def _proposer(run: RequestRun) -> str:
    """The drafter that proposed ``run``'s latest window: a composite's child, or the
    drafter itself."""
    drafter = run.drafter
    if isinstance(drafter, CompositeDrafter) and drafter.last_source is not None:
        return drafter.last_source.name
    return drafter.name if drafter is not None else "none"


class _EngineCollector(Collector):
    """The engine core's state, read when scraped (plain reads of counts: safe from
    the scrape's thread)."""

    def __init__(self, scheduler: PipelineScheduler) -> None:
        self._scheduler = scheduler

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        running, queued, recoveries, lookups, hits, lost, cached, held, cost = families[:9]
        corpus_docs, corpus_tokens, corpus_evictions, corpus_lookups, corpus_hits = families[9:14]
        in_flight, depth, windows_ahead, wasted, dropped, rereads = families[14:]
        scheduler = self._scheduler
        core = scheduler.core
        running.add_metric([], len(core.running))
        queued.add_metric([], core.queued)
        recoveries.add_metric([], core.recoveries)
        lookups.add_metric([], core.prefix_lookups)
        hits.add_metric([], core.prefix_hits)
        lost.add_metric([], core.prefix_lost)
        cached.add_metric([], core.cached_tokens_total)
        prefixes = core.prefixes
        held.add_metric(["held"], prefixes.held_tokens if prefixes is not None else 0)
        held.add_metric(["limit"], scheduler.limits.prefix_cache_tokens)
        model = core.step_cost.model()
        if model is not None:
            cost.add_metric(["fixed"], model[0] / 1000.0)
            cost.add_metric(["per_row"], model[1] / 1000.0)
        factory = scheduler.speculation
        corpus = getattr(factory, "corpus", None)
        stats = corpus.stats() if corpus is not None else None
        corpus_docs.add_metric([], stats.documents if stats else 0)
        corpus_tokens.add_metric([], stats.tokens if stats else 0)
        corpus_evictions.add_metric([], stats.evictions if stats else 0)
        corpus_lookups.add_metric([], stats.lookups if stats else 0)
        corpus_hits.add_metric([], stats.hits if stats else 0)
        speculating = [t for t in list(core.running.values()) if t.run.drafter is not None]
        in_flight.add_metric([], sum(len(ahead.windows(t)) for t in speculating))
        depth.add_metric([], max((t.depth for t in speculating), default=1))
        counters = core.ahead
        windows_ahead.add_metric(["sent"], counters.sent)
        windows_ahead.add_metric(["kept"], counters.kept)
        windows_ahead.add_metric(["dropped"], counters.dropped)
        wasted.add_metric([], counters.wasted_tokens)
        dropped.add_metric(["last_stage"], counters.dropped_by_last_stage)
        dropped.add_metric(["stage0"], counters.dropped)
        rereads.add_metric([], core.rereads)
        return iter(families)

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily("mesh_sessions_active", "Requests running in the engine core."),
            GaugeMetricFamily("mesh_requests_queued", "Requests waiting for a session slot."),
            CounterMetricFamily(
                "mesh_request_recoveries", "Requests resumed on a reloaded pipeline."
            ),
            CounterMetricFamily(
                "mesh_prefix_cache_lookups",
                "Prompts looked up in the prefix cache (kept positions of earlier requests).",
            ),
            CounterMetricFamily(
                "mesh_prefix_cache_hits", "Prompts whose session started from a kept prefix."
            ),
            CounterMetricFamily(
                "mesh_prefix_cache_lost",
                "Kept prefixes a stage no longer held when a session was to start from them "
                "(the prompt was read again from position 0).",
            ),
            CounterMetricFamily(
                "mesh_prefix_cache_tokens", "Prompt tokens whose prefill a kept prefix spared."
            ),
            GaugeMetricFamily(
                "mesh_prefix_cache_held_tokens",
                "Positions kept on every stage for later prompts (held), and the limit.",
                labels=("of",),
            ),
            GaugeMetricFamily(
                "mesh_step_cost_seconds",
                "The fitted cost of a decode step on the slowest stage: fixed (per frame) "
                "and per_row (per token row); speculation windows are sized from it.",
                labels=("part",),
            ),
            GaugeMetricFamily(
                "mesh_speculation_corpus_documents",
                "Finished requests the suffix drafter's shared corpus holds (all tenants).",
            ),
            GaugeMetricFamily(
                "mesh_speculation_corpus_tokens", "Tokens the shared corpus holds (all tenants)."
            ),
            CounterMetricFamily(
                "mesh_speculation_corpus_evictions",
                "Documents evicted from the shared corpus (least recently used first).",
            ),
            CounterMetricFamily(
                "mesh_speculation_corpus_lookups", "Proposals that searched the shared corpus."
            ),
            CounterMetricFamily(
                "mesh_speculation_corpus_hits",
                "Proposals that found a match in the shared corpus.",
            ),
            GaugeMetricFamily(
                "mesh_verify_windows_in_flight",
                "Verify and decode windows of speculating requests in the pipe now (the "
                "windows drafted ahead included).",
            ),
            GaugeMetricFamily(
                "mesh_verify_depth",
                "The deepest depth (windows one request may have in flight) the cost rule "
                "chose for a running request.",
            ),
            CounterMetricFamily(
                "mesh_verify_windows_ahead",
                "Windows drafted ahead of their predecessor's verdict: sent, kept (the "
                "verdict confirmed them) and dropped (a verdict refuted them).",
                labels=("outcome",),
            ),
            CounterMetricFamily(
                "mesh_verify_wasted_tokens",
                "Token rows of windows drafted ahead computed for nothing: refuted by a "
                "verdict (on the stages before the last) or still in flight when their "
                "request ended.",
            ),
            CounterMetricFamily(
                "mesh_verify_dropped_segments",
                "Windows drafted ahead found stale: stage0 counts every window a verdict "
                "refuted (voided on stage 0); last_stage counts those of them the last "
                "stage answered unrun (it checks each against the session's latest "
                "verdict). Not a split: the second is part of the first.",
                labels=("where",),
            ),
            CounterMetricFamily(
                "mesh_request_rereads",
                "Requests read again from position 0 because a stage no longer held "
                "their session (dropped as idle, or lost), or their answer never came back.",
            ),
        ]
