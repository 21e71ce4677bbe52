"""The coordinator's Prometheus series: terms, load attempts and their outcomes,
lost nodes, and its view of every node (health, place in the pipeline, the sessions
and KV cache its heartbeats report).

Load attempts and lost nodes are counted from the registry's events as the service
applies them (``observe``); the rest is read from the service's current state when a
scrape asks for it (``watch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator import registry as reg
from mesh.metrics import LATENCY_BUCKETS_S

# A load fetches slices and builds runtimes: seconds to many minutes.
LOAD_BUCKETS_S = (*LATENCY_BUCKETS_S, 300.0, 600.0, 1800.0)


class CoordinatorMetrics:
    """The coordinator's series in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.load_attempts = Counter(
            "mesh_coordinator_load_attempts_total",
            "Load attempts started (each with a new term).",
            registry=r,
        )
        self.loads = Counter(
            "mesh_coordinator_loads_total",
            "Load attempts by outcome: ok (the mesh serves the new term), failed (a stage "
            "failed a step; every stage was released), plan_failed (no plan fits the "
            "nodes alive).",
            ("outcome",),
            registry=r,
        )
        for outcome in ("ok", "failed", "plan_failed"):
            self.loads.labels(outcome=outcome)
        self.load_seconds = Histogram(
            "mesh_coordinator_load_seconds",
            "Time from the start of a load attempt to the mesh serving its term.",
            buckets=LOAD_BUCKETS_S,
            registry=r,
        )
        self.nodes_lost = Counter(
            "mesh_coordinator_nodes_lost_total",
            "Nodes declared dead after missed heartbeats.",
            registry=r,
        )
        self._load_started_at: float | None = None

    def watch(self, state: Callable[[], reg.State]) -> None:
        """Read the coordinator's state (``state()``) at every scrape."""
        self.registry.register(_StateCollector(state))

    def observe(self, before: reg.State, event: reg.Event, after: reg.State) -> None:
        """Count what ``event`` (applied to ``before``, giving ``after``) tells."""
        if isinstance(event, reg.LoadStarted):
            self.load_attempts.inc()
            self._load_started_at = time.monotonic()
        elif isinstance(event, reg.LoadSucceeded) and after is not before:
            self.loads.labels(outcome="ok").inc()
            if self._load_started_at is not None:
                self.load_seconds.observe(time.monotonic() - self._load_started_at)
                self._load_started_at = None
        elif isinstance(event, reg.LoadFailed) and after is not before:
            self.loads.labels(outcome="failed").inc()
            self._load_started_at = None
        elif isinstance(event, reg.PlanFailed):
            self.loads.labels(outcome="plan_failed").inc()
        elif isinstance(event, reg.HeartbeatsChecked) and after is not before:
            alive = {n.node_id for n in before.nodes if n.alive}
            lost = sum(1 for n in after.nodes if n.node_id in alive and not n.alive)
            if lost:
                self.nodes_lost.inc(lost)


class _StateCollector(Collector):
    """The coordinator's state, read when scraped (an immutable snapshot)."""

    def __init__(self, state: Callable[[], reg.State]) -> None:
        self._state = state

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        term, mesh_state, stages, health, up, index, node_term, sessions, kv, prefix = families
        state = self._state()
        term.add_metric([], state.term)
        for name in reg.MESH_STATES:
            mesh_state.add_metric([name], 1 if state.mesh_state == name else 0)
        plan = state.topology
        stages.add_metric([], len(plan.stages) if plan is not None else 0)
        for name in reg.HEALTH_STATES:
            health.add_metric([name], sum(1 for n in state.nodes if n.health == name))
        for node in state.nodes:
            labels = [node.node_id]
            assigned = plan.stage_of(node.node_id) if plan is not None else None
            up.add_metric(labels, 1 if node.alive else 0)
            index.add_metric(labels, assigned.stage_index if assigned is not None else -1)
            node_term.add_metric(labels, node.accepted_term)
            sessions.add_metric(labels, node.active_sessions)
            kv.add_metric(labels, node.kv_bytes)
            prefix.add_metric(labels, node.prefix_bytes)
        return iter(families)

    @staticmethod
    def _families() -> list[Metric]:
        node = ("node_id",)
        return [
            GaugeMetricFamily(
                "mesh_coordinator_term", "The coordinator's current term (the last load's)."
            ),
            GaugeMetricFamily(
                "mesh_coordinator_mesh_state",
                "1 for the mesh's state (waiting, loading, serving, failed), 0 for the others.",
                labels=("state",),
            ),
            GaugeMetricFamily(
                "mesh_coordinator_pipeline_stages", "Stages in the pipeline of the current term."
            ),
            GaugeMetricFamily(
                "mesh_coordinator_nodes",
                "Nodes the coordinator knows, by health.",
                labels=("health",),
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_up", "1 while a node heartbeats, 0 once dead.", labels=node
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_stage_index",
                "A node's place in the current pipeline (-1: not in it).",
                labels=node,
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_term", "The term a node reported holding.", labels=node
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_sessions",
                "Sessions a node holds, from its last heartbeat.",
                labels=node,
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_kv_bytes",
                "KV cache bytes of a node's sessions, from its last heartbeat.",
                labels=node,
            ),
            GaugeMetricFamily(
                "mesh_coordinator_node_prefix_kv_bytes",
                "KV cache bytes a node keeps for kept prefixes, from its last heartbeat.",
                labels=node,
            ),
        ]
