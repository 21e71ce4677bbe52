"""The coordinator service: membership, heartbeats, status, and the supervisor that
plans and loads the pipeline (and plans again when a stage is lost)."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc

from coordinator import balance, registry
from coordinator.driver import LoadDriver, LoadError, LoadSettings, release_nodes
from coordinator.metrics import CoordinatorMetrics
from coordinator.model import ModelInfo
from coordinator.planner import (
    ModelFootprint,
    Plan,
    StageAssignment,
    footprint_from_manifest,
    plan_layers,
)
from coordinator.rebalance import Rebalancer
from coordinator.topology_view import status_from_state
from mesh.codec import (
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    ProbeLinkReply,
    ProbeLinkRequest,
    StageStatus,
    StatusReply,
)
from mesh.codec_coordinator import check_join
from mesh.errors import MeshError
from mesh.grpc_util import abort_with, channel
from mesh.netaddr import split_host_port
from mesh.proto.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    data_pb2,
    data_pb2_grpc,
    stage_pb2_grpc,
)
from mesh.settings.sections import CoordinatorConfig
from mesh.types import RESTART_GRACE_S, LayerRange, check_term

logger = logging.getLogger(__name__)

# The longest a stage waits between heartbeat attempts after failed ones
# (stage/membership.py RETRY_MAX_S; the coordinator does not import stage code).
STAGE_RETRY_MAX_S = 5.0
# After a time in which no node at all was heard (this coordinator's network cut off),
# how long the stages get to be heard again before their heartbeats are judged: a
# heartbeat call of a stage may hang for its deadline (mesh/grpc_util.py
# CONTROL_DEADLINE_S, 10 s) and the stage then waits up to STAGE_RETRY_MAX_S.
UNHEARD_GRACE_S = 10.0 + STAGE_RETRY_MAX_S
# How long the coordinator tries to connect to a planned node before a load.
REACH_TIMEOUT_S = 3.0
# How long a stage gets to answer whether it can open a data link (it waits up to
# 3 s for the peer's gRPC port, then 3 s for its data port).
PROBE_LINK_TIMEOUT_S = 8.0
# Load steps whose failure at a worker leaves that worker out of plans for a while
# (a Claim a worker refuses or cannot answer: an --advertise address where another
# service listens, a process that is not a stage).
QUARANTINED_STEPS = frozenset({"Claim", "Prepare", "Inventory", "Load"})


@dataclass(frozen=True)
class CoordinatorSettings:
    load: LoadSettings
    min_stages: int = 1
    max_stages: int = 0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = CoordinatorConfig.heartbeat_timeout
    # Stage 0's oldest frame unanswered this long (or 10x its expected round) means
    # a stage's data path is stuck (registry "stalls"); 0: never.
    stall_timeout_s: float = CoordinatorConfig.stall_timeout
    # Dead nodes leave the registry (and `status`) after this long (0: never).
    forget_dead_after_s: float = CoordinatorConfig.forget_dead_after
    supervise_interval_s: float = 0.25
    # A failed load is tried again after retry_backoff_s, doubling per failure up
    # to retry_backoff_max_s.
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 30.0
    # Before the mesh has ever served, give up after this many failed attempts in a
    # row (0: never); `up` then exits non-zero with the last error.
    load_attempts: int = CoordinatorConfig.load_attempts
    # The highest term used before this coordinator started (from its state file).
    term_floor: int = 0
    # The state file says an earlier coordinator of this model served: this one was
    # restarted. After restart_grace_s it plans with the stages alive, as after a
    # loss, instead of waiting for min_stages (and it never gives up).
    served_before: bool = False
    restart_grace_s: float = RESTART_GRACE_S
    # A frontend node is expected (``up`` starts stage 0 with the frontend itself, or
    # the state file says the mesh served HTTP): no pipeline is planned before one
    # has joined. Before, a restarted coordinator whose grace ended as a worker
    # joined planned a whole pipeline on that worker, with no frontend.
    expect_frontend: bool = False
    # Serving on fewer than min_stages while more nodes are alive (a lost stage came
    # back): plan again once stage 0 is idle, or after this long even if busy
    # (in-flight requests then resume on the new pipeline).
    regrow_busy_after_s: float = 60.0
    # Stage 0's memory besides the model's embeddings and layers: the draft model's
    # weights and KV budget (coordinator/stage0_budget.py).
    stage0_extra_bytes: int = 0
    # Plan again when the stages' measured step times differ by more than this
    # (0.15: 15%) and stage 0 is idle; 0: never.
    rebalance_spread: float = CoordinatorConfig.rebalance_spread
    # Frames every stage must have measured before their step times are compared,
    # and the least time between two rebalance checks.
    rebalance_min_frames: int = balance.MIN_STEP_FRAMES
    rebalance_check_s: float = 10.0


class CoordinatorService:
    """Owns the registry state; every change goes through ``registry.apply``."""

    def __init__(
        self,
        model: ModelInfo,
        settings: CoordinatorSettings,
        on_term: Callable[[int], None] | None = None,
    ) -> None:
        """``on_term`` is called with each new term before any stage hears of it
        (`up` persists it, so a restarted coordinator never reuses a term)."""
        self.coordinator_id = f"coord-{uuid.uuid4().hex[:8]}"
        self.model = model
        self.settings = settings
        self._on_term = on_term
        self._lock = threading.RLock()
        self.state = registry.apply(
            registry.State(),
            registry.ModelSelected(
                model_id=model.manifest.model_id,
                package_ref=model.ref,
                layer_count=model.manifest.layer_count,
            ),
        )
        self.state = registry.apply(self.state, registry.TermObserved(term=settings.term_floor))
        self._failures = 0
        self._undersized_since: float | None = None
        # Set when `up` should give up: the last error after load_attempts failures.
        self.gave_up: str | None = None
        self._driver = LoadDriver(self.coordinator_id, self._device_of, self._slice_progress)
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._last_attempt = 0.0
        self.rebalancer = Rebalancer(
            settings.rebalance_spread, settings.rebalance_min_frames, settings.rebalance_check_s
        )
        self._served_once = False
        self._started = time.monotonic()
        # The plan whose slices are prepared while another pipeline serves (its
        # nodes may read their slices' files from the package server meanwhile).
        self._preparing: Plan | None = None
        # (node id, address) of processes told their node id was taken (logged once).
        self._superseded_seen: set[tuple[str, str]] = set()
        # Heartbeats are judged from this time on (set when this process was found
        # to have stopped running for longer than a heartbeat timeout).
        self._judged_from = -math.inf
        # No node has been heard for a heartbeat timeout while the mesh serves
        # (``_unheard``): nothing is judged until one is.
        self._unheard = False
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        # Prometheus series (coordinator/metrics.py); `up` serves them on --metrics-port.
        self.metrics = CoordinatorMetrics()
        self.metrics.watch(lambda: self.state)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    # ---- state -------------------------------------------------------------------

    def apply(self, event: registry.Event) -> registry.State:
        with self._lock:
            before, self.state = self.state, registry.apply(self.state, event)
            if self.state is not before:  # an unchanged state must not wake the supervisor
                self._changed.set()
            self.metrics.observe(before, event, self.state)
            return self.state

    def assigned_ranges(self, node_id: str) -> list[LayerRange]:
        """The layer ranges ``node_id`` may read the package files of: its range in
        the current plan, and in the plan whose slices are prepared ahead of a load."""
        plans = (self.state.topology, self._preparing)
        stages = [p.stage_of(node_id) for p in plans if p is not None]
        return [s.layer_range for s in stages if s is not None]

    def _slice_progress(self, node_id: str, bytes_done: int, bytes_total: int) -> None:
        self.apply(
            registry.SliceProgress(node_id=node_id, bytes_done=bytes_done, bytes_total=bytes_total)
        )

    def _device_of(self, node_id: str) -> str:
        node = self.state.node(node_id)
        return node.device if node is not None else "cpu"

    def join(self, request: JoinRequest) -> JoinReply:
        check_join(request)
        self.apply(
            registry.NodeJoined(
                node_id=request.node_id,
                address=request.address,
                now=time.monotonic(),
                device=request.device,
                memory_bytes=request.memory_bytes,
                speed_hint=request.speed_hint,
                frontend=request.frontend,
                http_url=request.http_url,
                term=request.term,
                memory_source=request.memory_source,
            )
        )
        logger.info(
            "node %s joined from %s (%s, %s, holding term %s)",
            request.node_id,
            request.address,
            request.device,
            f"{request.memory_bytes / 2**30:.2f} GiB {request.memory_source}"
            if request.memory_bytes
            else "memory unknown",
            request.term,
        )
        return JoinReply(
            coordinator_id=self.coordinator_id,
            heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
        )

    def heartbeat(self, request: HeartbeatRequest) -> HeartbeatReply:
        check_term(request.term, "Heartbeat")
        with self._lock:
            if not self.state.is_known(request.node_id):
                return HeartbeatReply(known=False, term=self.state.term)
            record = self.state.node(request.node_id)
            if request.address and record is not None and request.address != record.address:
                # The node id belongs to the process that joined last; once that one
                # is dead, a process still beating with the id joins again and takes it.
                if record.health == "dead":
                    return HeartbeatReply(known=False, term=self.state.term)
                self._superseded(request.node_id, request.address, record.address)
                return HeartbeatReply(
                    known=True, term=self.state.term, superseded_by=record.address
                )
            self.state = registry.apply(
                self.state,
                registry.HeartbeatReceived(
                    node_id=request.node_id,
                    now=time.monotonic(),
                    term=request.term,
                    stage_state=request.state,
                    active_sessions=request.active_sessions,
                    kv_bytes=request.kv_bytes,
                    prefix_bytes=request.prefix_bytes,
                    step_ms=request.step_ms,
                    step_frames=request.step_frames,
                    link_error=request.link_error,
                    progress=request.progress,
                ),
            )
            return HeartbeatReply(known=True, term=self.state.term)

    def _superseded(self, node_id: str, address: str, current: str) -> None:
        """Log, once per process, a heartbeat from a process the node id was taken
        from (two processes with one node id, or an old one living on)."""
        if (node_id, address) in self._superseded_seen:
            return
        self._superseded_seen.add((node_id, address))
        logger.warning(
            "node %s: a process at %s heartbeats with this node id, which the process "
            "at %s took by joining later; its heartbeats are not counted and it was told to "
            "serve nothing (it takes the id back if that process dies). Two processes must "
            "not share a node id: give each stage its own --node-id (or --cache-dir, from "
            "which the default id is made)",
            node_id,
            address,
            current,
        )

    def status(self) -> StatusReply:
        now = time.monotonic()
        with self._lock:
            view = status_from_state(self.state, now=now, coordinator_id=self.coordinator_id)
            steps = {s.node_id: s for s in balance.stage_steps(self.state, self._footprint())}
            waiting = registry.waiting_for(
                self.state,
                min_stages=self.settings.min_stages,
                served_once=self._has_served(self.state, now),
                retry_in_s=max(0.0, self._last_attempt + self._backoff_s() - now),
                gave_up=self.gave_up,
                expect_frontend=self.settings.expect_frontend,
            )
        return StatusReply(
            coordinator_id=view.coordinator_id,
            state=view.state,
            model_id=view.model_id,
            package_ref=view.package_ref,
            term=view.term,
            error=view.error,
            http_url=view.http_url,
            layer_count=view.layer_count,
            stages=tuple(_stage_status(stage, steps.get(stage.node_id)) for stage in view.stages),
            waiting_for=waiting,
        )

    # ---- supervision -------------------------------------------------------------

    def _supervise(self) -> None:
        last_pass = time.monotonic()
        while not self._stop.is_set():
            self._changed.wait(self.settings.supervise_interval_s)
            self._changed.clear()
            if self._stop.is_set():
                return
            self._forgive_gap(last_pass)
            try:
                self._supervise_once()
            except Exception:  # noqa: BLE001 - supervision must outlive any one pass
                # An exception here would end the thread silently: no stage would
                # ever be found dead or stalled again, no load retried.
                logger.exception("supervision pass failed; the next one goes on")
            # From the end of a pass: a pass that loads may take minutes (heartbeats
            # are taken meanwhile); only a wait that overran means a stopped process.
            last_pass = time.monotonic()

    def _forgive_gap(self, last_check: float) -> None:
        """When this process did not run for a while since ``last_check`` (stopped, a
        paused VM, a starved host), the heartbeats it missed meanwhile were not the
        stages' fault: judge silence from now on."""
        now = time.monotonic()
        if now - last_check <= self.settings.heartbeat_timeout_s:
            return
        logger.warning(
            "the coordinator's checks ran %.1f s late (was it stopped or starved?); "
            "judging the stages' heartbeats from now on",
            now - last_check,
        )
        # Beyond a heartbeat timeout from now: a stage whose heartbeats failed
        # meanwhile waits up to its longest retry pause before the next one.
        self._judged_from = now + STAGE_RETRY_MAX_S

    def _nobody_heard(self, state: registry.State, now: float) -> bool:
        """While the mesh serves, no node at all has been heard lately (none for half a
        heartbeat timeout, or one and a half beats, and one for longer than the
        timeout): this coordinator's own network is the likelier fault (a firewall, a
        route, its host's link), and the stages serve on without it. Judging them dead
        would release them, and fence the pipeline that serves once they are heard
        again; so nothing is judged until one is, and then the others get
        UNHEARD_GRACE_S to be heard too. A real loss of every stage is judged once
        any stage is heard again (a restarted one joins again); until then `status`
        shows their heartbeats' ages."""
        timeout = self.settings.heartbeat_timeout_s
        quiet = max(timeout / 2, 1.5 * self.settings.heartbeat_interval_s)
        ages = [
            now - max(n.last_heartbeat_at, self._judged_from)
            for n in state.nodes
            if n.health != "dead"
        ]
        unheard = (
            state.mesh_state == "serving"
            and bool(ages)
            and min(ages) > quiet
            and (self._unheard or max(ages) > timeout)
        )
        if unheard and not self._unheard:
            logger.warning(
                "no stage has been heard for %.1f s: this coordinator's network may be cut "
                "off (the stages serve on without it); judging nothing until one is heard",
                min(ages),
            )
        elif self._unheard and not unheard:
            logger.warning(
                "a stage is heard again; the others have %.0f s to be heard before their "
                "heartbeats are judged",
                UNHEARD_GRACE_S,
            )
            self._judged_from = max(self._judged_from, now + UNHEARD_GRACE_S - timeout)
        self._unheard = unheard
        return unheard

    def _judge_while_loading(self) -> Callable[[], registry.State]:
        """A check of the stages' heartbeats for a wait inside a load attempt, which
        forgives a gap in its own calls as the supervision loop does."""
        last = [time.monotonic()]

        def check() -> registry.State:
            self._forgive_gap(last[0])
            last[0] = time.monotonic()
            return self._check_heartbeats()

        return check

    def _supervise_once(self) -> None:
        """Check heartbeats and progress, then load, grow or rebalance as needed."""
        after = self._check_heartbeats()
        if self._should_load(after):
            self._load_once()
        elif self._should_regrow(after):
            # Before the regrow has waited out a busy stage 0, stage 0 says at the
            # Claim whether it is still idle (its heartbeat may be a second old).
            since = self._undersized_since or time.monotonic()
            waited = time.monotonic() - since >= self.settings.regrow_busy_after_s
            self._load_once(grow_from=len(after.topology.stages), if_idle=not waited)
        elif self._should_rebalance(after):
            self._rebalance(after)

    def _check_heartbeats(self) -> registry.State:
        """Judge the stages' heartbeats and progress now; a lost stage of the pipeline
        releases the others at once. Returns the state after."""
        before = self.state
        if self._nobody_heard(before, time.monotonic()):
            return before
        after = self.apply(
            registry.HeartbeatsChecked(
                now=time.monotonic(),
                timeout_s=self.settings.heartbeat_timeout_s,
                forget_after_s=self.settings.forget_dead_after_s,
                stall_timeout_s=self.settings.stall_timeout_s,
                judged_from=self._judged_from,
            )
        )
        if before.topology is not None and after.topology is None and after.degraded:
            self._release_survivors(before)
        return after

    def _should_load(self, state: registry.State) -> bool:
        if self.gave_up is not None:
            return False
        # A failed load is retried (with backoff) even when no node came or went: the
        # cause may have been passing (a stage restarting, a slow download).
        retry = state.mesh_state == "failed" and bool(registry.alive_nodes(state))
        if not (registry.needs_replan(state) or retry):
            return False
        # min_stages gates the first load only; after a loss, serve with who is left.
        # A node quarantined meanwhile has joined: the load goes ahead without it.
        needed = 1 if self._has_served(state, time.monotonic()) else self.settings.min_stages
        if len(registry.joined_nodes(state)) < needed or not registry.alive_nodes(state):
            return False
        if registry.frontend_missing(state, self.settings.expect_frontend):
            return False
        return time.monotonic() - self._last_attempt >= self._backoff_s()

    def _has_served(self, state: registry.State, now: float) -> bool:
        """Whether this mesh has served: this process loaded a pipeline, or it was
        restarted after an earlier coordinator served (its state file says so, or a
        stage reports serving a pipeline now) and ``restart_grace_s`` has passed,
        for the stages alive to join it again. Then a load goes ahead with the stages
        alive, as after a loss (``min_stages`` gates a mesh's first load only), and
        failed loads are retried for ever."""
        if self._served_once:
            return True
        if now - self._started < self.settings.restart_grace_s:
            return False
        return self.settings.served_before or any(
            n.stage_state == "serving" and n.accepted_term > 0 for n in registry.alive_nodes(state)
        )

    def _should_regrow(self, state: registry.State) -> bool:
        if not registry.undersized(state, self.settings.min_stages):
            self._undersized_since = None
            return False
        now = time.monotonic()
        if self._undersized_since is None:
            self._undersized_since = now
        if now - self._last_attempt < self._backoff_s():
            return False
        busy_s = now - self._undersized_since
        return registry.frontend_idle(state) or busy_s >= self.settings.regrow_busy_after_s

    def _should_rebalance(self, state: registry.State) -> bool:
        now = time.monotonic()
        if now - self._last_attempt < self._backoff_s():
            return False
        return self.rebalancer.due(state, now)

    def _rebalance(self, state: registry.State) -> None:
        """Plan again with the measured compute (coordinator/rebalance.py decides)."""
        plan = self.rebalancer.decide(state, self._footprint(), self._plan, time.monotonic())
        if plan is not None:
            self._load_once(plan=plan, if_idle=True)

    def _backoff_s(self) -> float:
        if self._failures == 0:
            return self.settings.retry_backoff_s
        doubled = self.settings.retry_backoff_s * 2 ** (self._failures - 1)
        return min(self.settings.retry_backoff_max_s, doubled)

    def _failed(self, error: str) -> None:
        """Count a failed attempt; before the mesh ever served, give up after
        load_attempts of them in a row."""
        self._failures += 1
        limit = self.settings.load_attempts
        served = self._has_served(self.state, time.monotonic())
        if not served and limit > 0 and self._failures >= limit:
            self.gave_up = f"the model could not be loaded after {self._failures} attempts: {error}"
            logger.error("%s", self.gave_up)
        else:
            logger.info("load attempt failed; trying again in %.0fs", self._backoff_s())

    def _release_survivors(self, before: registry.State) -> None:
        """After a stage is lost, release the others at once so that stage 0 stops
        accepting work it cannot finish (503 until the new pipeline is loaded)."""
        survivors = [
            (s.node_id, s.address)
            for s in before.topology.stages
            if (node := self.state.node(s.node_id)) is not None and node.health == "alive"
        ]
        release_nodes(survivors, before.term, "a stage of the pipeline was lost")

    def _footprint(self) -> ModelFootprint:
        load = self.settings.load
        return footprint_from_manifest(
            self.model.manifest,
            dtype=load.torch_dtype,
            max_sessions=load.max_sessions,
            max_tokens_per_session=load.max_tokens_per_session,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            stage0_extra_bytes=self.settings.stage0_extra_bytes,
        )

    def _unreachable(self, plan: Plan, state: registry.State) -> list[tuple[str, str]]:
        """(node id, why) of the plan's nodes the coordinator cannot connect to, tried
        at once for up to ``REACH_TIMEOUT_S``. The nodes serving the current term are
        not tried (their frames flow); a load that claimed every other stage before
        finding a node it cannot reach would stop the pipeline serving now for a plan
        that cannot load."""
        serving = (
            {s.node_id for s in state.topology.stages}
            if state.topology is not None and state.mesh_state == "serving"
            else set()
        )
        tried = [s for s in plan.stages if s.node_id not in serving]
        channels = {s.node_id: channel(s.address) for s in tried}
        try:
            futures = {n: grpc.channel_ready_future(c) for n, c in channels.items()}
            deadline = time.monotonic() + REACH_TIMEOUT_S
            failed = []
            for stage in tried:
                try:
                    futures[stage.node_id].result(timeout=max(0.0, deadline - time.monotonic()))
                except grpc.FutureTimeoutError:
                    failed.append(
                        (
                            stage.node_id,
                            f"cannot connect to its address {stage.address} within "
                            f"{REACH_TIMEOUT_S:.0f} s: give the node an --advertise address "
                            "the coordinator and the other stages can reach",
                        )
                    )
                    continue
                problem = _data_port_problem(channels[stage.node_id])
                if problem:
                    failed.append((stage.node_id, problem))
            return failed or _unlinkable(plan, state)
        finally:
            for ch in channels.values():
                ch.close()

    def _plan(self, state: registry.State, footprint: ModelFootprint) -> Plan:
        nodes = balance.planning_nodes(state, footprint)
        return plan_layers(nodes, footprint, max_stages=self.settings.max_stages or None)

    def _quarantine(self, node_id: str, why: str, error: LoadError) -> None:
        """Leave a worker whose load failed out of plans for a while."""
        logger.warning("node %s is left out of plans: %s", node_id, why)
        self.apply(
            registry.NodeUnreachable(
                node_id=node_id, error=f"its load failed: {error.message}", now=time.monotonic()
            )
        )

    def _slices_ready(self, plan: Plan, term: int, state: registry.State) -> bool:
        """For a plan made while a pipeline serves (growing back, a rebalance): get
        every slice the plan needs ready before the load fences the serving stages,
        which go on answering meanwhile (before, the mesh answered 503 for as long as
        a newcomer took to fetch its layers). Nodes new to the pipeline are claimed
        and prepared; serving stages whose layers change prepare them at the term
        they serve. False when the attempt ends here: a newcomer failed (it is left
        out of plans for a while), or the serving pipeline changed meanwhile."""
        serving = _serving_now(state, adopt=not self._served_once)
        newcomers, moved = _ahead(plan, serving)
        if serving is None or (not newcomers and not moved):
            return True
        serving_term = serving[0]
        logger.info(
            "term %s: slices for %s prepared while term %s serves",
            term,
            ", ".join(f"{s.node_id} {s.layer_range}" for s in newcomers + moved),
            serving_term,
        )

        judge = self._judge_while_loading()

        def abort() -> str | None:
            now = _serving_now(judge(), adopt=not self._served_once)
            if now is None or now[0] != serving_term or not set(serving[1]) <= set(now[1]):
                return f"the pipeline of term {serving_term} stopped serving meanwhile"
            lost = [s.node_id for s in newcomers if not _alive(self.state, s.node_id)]
            if lost:
                return f"node(s) {', '.join(lost)} were lost while preparing"
            return None

        self._preparing = plan
        try:
            self._driver.stage_ahead(
                newcomers, term, moved, serving_term, self.settings.load, abort
            )
        except LoadError as error:
            self._preparing = None
            # Newcomers may have taken ``term``: it is never used again (terms fence
            # off old work only while they grow; a newcomer restarted since would
            # report none of it).
            self.apply(registry.TermObserved(term=term))
            if error.step == "Abort":
                logger.info("term %s not loaded: %s", term, error.message)
                self._last_attempt = 0.0  # plan again at once, from what is left
                return False
            if error.held_term > term:
                self.apply(registry.TermObserved(term=error.held_term))
                self._last_attempt = 0.0
                return False
            stage = error.stage
            is_newcomer = stage is not None and stage in newcomers
            if is_newcomer and error.step in QUARANTINED_STEPS:
                why = "it could not prepare its slice"
                if error.step == "Claim":
                    why = "it did not take the Claim"
                self._quarantine(stage.node_id, why, error)
                self._last_attempt = 0.0
            self._failed(error.message)
            return False
        return True

    def _stage0_idle(self, plan: Plan, term: int) -> bool:
        """Claim stage 0 with ``term`` only if it serves no request at that moment
        (the heartbeat that said it was idle may be a second old). False, with
        nothing fenced, when it is busy (the pipeline serving now goes on; the next
        check tries again) or cannot be claimed."""
        try:
            self._driver.claim_if_idle(plan.stages[0], term, self.settings.load)
        except LoadError as error:
            self.apply(registry.TermObserved(term=term))  # never used again
            self.rebalancer.reset()
            if error.busy:
                logger.info("term %s not loaded now: %s", term, error.message)
            else:
                logger.warning("term %s not loaded: %s", term, error.message)
                self._failed(error.message)
            return False
        return True

    def _load_once(
        self, grow_from: int = 0, plan: Plan | None = None, if_idle: bool = False
    ) -> None:
        """Plan and load a new term. With ``grow_from`` (the stage count serving now),
        load only when the plan uses more stages than that; ``plan``: load this one;
        ``if_idle``: only if stage 0 serves no request when it is claimed (a reload
        that only pays when idle must not cut running requests: the heartbeat that
        said idle may be a second old)."""
        self._last_attempt = time.monotonic()
        load = self.settings.load
        if plan is None:  # planned for another reason than a rebalance
            self.rebalancer.reset()
        with self._lock:
            state = self.state
        try:
            plan = plan if plan is not None else self._plan(state, self._footprint())
        except MeshError as error:
            if grow_from:  # the pipeline serving now stays as it is
                logger.info("cannot plan a larger pipeline: %s", error.message)
                return
            logger.error("cannot plan: %s", error.message)
            self.apply(registry.PlanFailed(error=error.message))
            self._failed(error.message)
            return
        if grow_from and len(plan.stages) <= grow_from:
            return
        if grow_from:
            logger.info(
                "serving on %s stage(s) with %s alive node(s): planning again on %s",
                grow_from,
                len(registry.alive_nodes(state)),
                len(plan.stages),
            )
        unreachable = self._unreachable(plan, state)
        if unreachable:
            # Nothing was claimed: the pipeline serving now (if any) stays as it is,
            # and the next plan leaves these nodes out.
            for node_id, error in unreachable:
                logger.warning("node %s is left out of plans: %s", node_id, error)
                self.apply(
                    registry.NodeUnreachable(node_id=node_id, error=error, now=time.monotonic())
                )
            self._last_attempt = 0.0
            return
        term = registry.next_term(state)
        if self._on_term is not None:
            try:
                self._on_term(term)
            except OSError as error:
                # A full or read-only disk must not stop the mesh from failing over:
                # the file only helps a restarted coordinator, which also goes above
                # every term its stages report.
                logger.error("cannot record term %s in the state file: %s", term, error)
        if not self._slices_ready(plan, term, state):
            self.rebalancer.reset()  # nothing was loaded: a rebalance was not tried
            return
        if if_idle and not self._stage0_idle(plan, term):
            return
        logger.info("term %s: loading\n%s", term, plan.describe())
        self.apply(registry.LoadStarted(term=term, plan=plan))
        self._preparing = None  # the plan is the current one now
        judge = self._judge_while_loading()

        def abort() -> str | None:
            # The stages' heartbeats are judged while they load: one that stops (a
            # stopped process, a swapping host) ends the attempt, as it would end a
            # serving pipeline, instead of holding the fenced mesh for the Load deadline.
            now = judge()
            lost = [s.node_id for s in plan.stages if not _alive(now, s.node_id)]
            return f"node(s) {', '.join(lost)} were lost while loading" if lost else None

        try:
            outcome = self._driver.load(plan, term, load, abort)
        except LoadError as error:
            self.apply(registry.LoadFailed(term=term, error=error.message))
            if error.step == "Abort":
                # Not a failure of the model: plan again at once, from who is left.
                logger.warning("term %s not loaded: %s", term, error.message)
                self._last_attempt = 0.0
                return
            if error.held_term > term:
                # A stage holds a newer term (a coordinator before this one used it):
                # claim again at once, above it. Not a failure of the model.
                logger.info("stage holds term %s; claiming again above it", error.held_term)
                self.apply(registry.TermObserved(term=error.held_term))
                self._last_attempt = 0.0
                return
            stage = _to_blame(plan, error)
            if stage is not None and stage.stage_index > 0 and error.step in QUARANTINED_STEPS:
                # One worker cannot take its slice (a corrupt local copy of the package,
                # a fetch that ran out of time, a load that failed): plan around it
                # for a quarantine, at once, rather than trying the same plan again
                # and again while the mesh serves nothing (stage 0 is not left out:
                # no plan is made without it).
                why = f"its load failed at {error.step}"
                if stage is not error.stage and error.stage is not None:
                    why = (
                        f"stage {error.stage.stage_index} could not open its data link to it "
                        "at Load (a firewall or route between them)"
                    )
                self._quarantine(stage.node_id, why, error)
                self._failed(error.message)
                self._last_attempt = 0.0
                return
            self._failed(error.message)
            return
        for stage, ready in zip(plan.stages, outcome.ready, strict=True):
            self.apply(
                registry.StageReady(
                    node_id=stage.node_id,
                    param_bytes=ready.param_bytes,
                    term=term,
                    now=time.monotonic(),
                    layer_ms=ready.layer_ms,
                    head_ms=ready.head_ms,
                )
            )
        self.apply(registry.LoadSucceeded(term=term))
        self._served_once = True
        self._failures = 0
        self._undersized_since: float | None = None
        logger.info("term %s: serving %s", term, self.model.manifest.model_id)


def _alive(state: registry.State, node_id: str) -> bool:
    node = state.node(node_id)
    return node is not None and node.health == "alive"


def _serving_now(
    state: registry.State, adopt: bool
) -> tuple[int, dict[str, LayerRange | None]] | None:
    """The pipeline that serves now, as (its term, node id -> layer range): this
    coordinator's serving topology; else, with ``adopt`` (a coordinator that has not
    loaded a pipeline yet: it was restarted while one served), the alive nodes that
    report serving the term stage 0 serves, ranges unknown (None). None when no
    pipeline serves."""
    if state.topology is not None:
        if state.mesh_state != "serving":
            return None
        return state.term, {s.node_id: s.layer_range for s in state.topology.stages}
    if not adopt:
        return None
    alive = registry.alive_nodes(state)
    heads = [n for n in alive if n.frontend and n.stage_state == "serving" and n.accepted_term]
    if not heads:
        return None
    term = heads[0].accepted_term
    nodes = [n for n in alive if n.stage_state == "serving" and n.accepted_term == term]
    return term, {n.node_id: None for n in nodes}


def _ahead(
    plan: Plan, serving: tuple[int, dict[str, LayerRange | None]] | None
) -> tuple[list[StageAssignment], list[StageAssignment]]:
    """The plan's stages whose slices can be prepared while the pipeline serving now
    (``_serving_now``) goes on: (stages on nodes outside that pipeline, stages of its
    nodes whose layer range changes or is not known). Nothing when no pipeline
    serves."""
    if serving is None:
        return [], []
    ranges = serving[1]
    newcomers = [s for s in plan.stages if s.node_id not in ranges]
    moved = [s for s in plan.stages if s.node_id in ranges and ranges[s.node_id] != s.layer_range]
    return newcomers, moved


def _stage_status(stage, step: balance.StageStep | None) -> StageStatus:
    """A node's status row, with its planned and measured step time when it holds a stage."""
    status = StageStatus(**vars(stage))
    if step is None:
        return status
    return replace(status, planned_step_ms=step.planned_ms, measured_step_ms=step.measured_ms)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, service: CoordinatorService) -> None:
        self.service = service

    def Join(self, request: coordinator_pb2.JoinRequest, context) -> coordinator_pb2.JoinReply:
        try:
            return self.service.join(JoinRequest.from_proto(request)).to_proto()
        except MeshError as error:
            abort_with(context, error)

    def Heartbeat(self, request, context) -> coordinator_pb2.HeartbeatReply:
        try:
            return self.service.heartbeat(HeartbeatRequest.from_proto(request)).to_proto()
        except MeshError as error:
            abort_with(context, error)

    def Status(self, request, context) -> coordinator_pb2.StatusReply:
        return self.service.status().to_proto()


def serve(service: CoordinatorService, listen: str, workers: int = 16) -> tuple[grpc.Server, int]:
    from coordinator.package_server import PackageFilesServicer
    from mesh.grpc_util import bind, new_server

    server = new_server(workers)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(service), server)
    coordinator_pb2_grpc.add_PackageFilesServicer_to_server(PackageFilesServicer(service), server)
    port = bind(server, listen)
    server.start()
    return server, port


def _to_blame(plan: Plan, error: LoadError) -> StageAssignment | None:
    """The stage whose node a failed load is held against: the one that failed, except
    where it could not open its data link: then the node that link was to reach (the
    next stage's for a forward link; a last stage that cannot reach stage 0 is itself
    the one to leave out, since no plan is made without stage 0)."""
    stage = error.stage
    if stage is None or error.unreachable_link != "forward":
        return stage
    following = [s for s in plan.stages if s.stage_index == stage.stage_index + 1]
    return following[0] if following else stage


def _new_links(
    plan: Plan, state: registry.State
) -> list[tuple[StageAssignment, StageAssignment, StageAssignment | None]]:
    """(from, to, to blame) of the data links ``plan`` has that the pipeline serving
    now has not (those carry frames already): each stage's forward link to the next,
    and the last stage's return link to stage 0. A forward link that cannot be
    opened is held against the stage it goes to, a return link against the last
    stage (as ``_to_blame`` does for a failed load); but never against a node of the
    pipeline serving now (that would fail it over) or stage 0: then against the
    link's other end, or, when that is one too, nobody (None)."""
    stages = sorted(plan.stages, key=lambda s: s.stage_index)
    serving: set[tuple[str, str]] = set()
    serving_nodes: set[str] = set()
    if state.topology is not None and state.mesh_state == "serving":
        now = sorted(state.topology.stages, key=lambda s: s.stage_index)
        serving_nodes = {s.node_id for s in now}
        serving = {(a.node_id, b.node_id) for a, b in zip(now, now[1:], strict=False)}
        if len(now) > 1:
            serving.add((now[-1].node_id, now[0].node_id))

    def blamable(stage: StageAssignment) -> bool:
        return stage.stage_index > 0 and stage.node_id not in serving_nodes

    links = []
    pairs = list(zip(stages, stages[1:], strict=False))
    if len(stages) > 1:
        pairs.append((stages[-1], stages[0]))
    for source, target in pairs:
        if (source.node_id, target.node_id) in serving:
            continue
        first, other = (target, source) if target.stage_index > 0 else (source, target)
        blamed = first if blamable(first) else other if blamable(other) else None
        links.append((source, target, blamed))
    return links


def _unlinkable(plan: Plan, state: registry.State) -> list[tuple[str, str]]:
    """(node id, why) of the nodes to leave out because a data link of ``plan`` that
    the serving pipeline does not have cannot be opened, asked of the stage that
    would open it (``ProbeLink``), all at once. A partition between two workers
    leaves the coordinator able to reach both; without this the load would fence
    the serving pipeline and only then fail at that link, an outage each time the
    node's quarantine ended. A stage that does not know ``ProbeLink`` (older), or
    does not answer, is not judged here. Only asked while a pipeline serves: with
    none serving, the load itself finds the link and its error names the address
    (and a first load that cannot link its stages exits with that error)."""
    if state.topology is None or state.mesh_state != "serving":
        return []
    links = _new_links(plan, state)
    if not links:
        return []

    def probe(link: tuple[StageAssignment, StageAssignment, StageAssignment | None]) -> str:
        source, target, _ = link
        ch = channel(source.address)
        try:
            reply = ProbeLinkReply.from_proto(
                stage_pb2_grpc.StageControlStub(ch).ProbeLink(
                    ProbeLinkRequest(address=target.address).to_proto(),
                    timeout=PROBE_LINK_TIMEOUT_S,
                )
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                logger.info(
                    "cannot ask %s about its link to %s: %s",
                    source.node_id,
                    target.node_id,
                    error.code().name,
                )
            return ""
        finally:
            ch.close()
        return reply.error

    with ThreadPoolExecutor(max_workers=min(8, len(links))) as pool:
        errors = list(pool.map(probe, links))
    failed: dict[str, str] = {}
    for (source, target, blamed), error in zip(links, errors, strict=True):
        if error and blamed is not None and blamed.node_id not in failed:
            failed[blamed.node_id] = (
                f"stage {source.stage_index} ({source.node_id}) cannot open its data link "
                f"to {target.node_id}: {error}"
            )
    return list(failed.items())


def _data_port_problem(ch: grpc.Channel) -> str | None:
    """Why the stage behind ``ch`` cannot take data links, or None: its framed TCP
    data port (which it names over gRPC) does not accept a connection from here, as
    when a firewall opens only its control port. A node found so before a load is
    left out of it, instead of failing the load after the serving stages were fenced.
    A stage without that port (``--data-transport grpc``) or that does not say is
    not judged here."""
    try:
        reply = data_pb2_grpc.StageDataStub(ch).Endpoint(
            data_pb2.EndpointRequest(), timeout=REACH_TIMEOUT_S
        )
    except grpc.RpcError:
        return None
    if not reply.tcp:
        return None
    try:
        host, port = split_host_port(reply.tcp)
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError) as error:
        return (
            f"its data port {reply.tcp} does not accept connections ({error}): open it to "
            "the other stages (the stage's --data-port), as well as its control port"
        )
    return None
