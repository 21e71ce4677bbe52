"""The coordinator's state as pure data, changed only by ``apply(state, event)``.

Every input the coordinator reacts to (a join, a heartbeat, the heartbeat sweep,
the steps of a load) is a frozen event; ``apply`` returns a new frozen ``State``
and never does I/O. Times are plain seconds from whatever clock the caller uses
for every event (``time.monotonic()`` in the server).

Invariants:

- ``topology`` is set only while the mesh is ``loading`` or ``serving``; a node is
  *assigned* when the topology names it. Every assigned node is known and alive.
- Losing an assigned node (missed heartbeats, leaving, or re-joining, which means
  its process restarted and lost its layers) makes the mesh ``failed`` and
  ``degraded``: the topology is dropped and the error names the stage.
- ``needs_replan`` is true while nothing is loaded yet, after a degradation, and
  after a failure once the set of alive nodes has changed (a new node may be what
  the model needed); it is never true while loading or serving.
- Terms only grow, across coordinator restarts too: ``next_term`` is above the
  current term, every term a node reports (on join and heartbeat) and
  ``term_floor`` (a persisted term, or one a stage refused a claim with).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from coordinator.planner import NodeCapacity, Plan
from mesh.errors import InvalidRequest, StaleTerm
from mesh.frames import FrameProgress
from mesh.types import STALL_ROUND_FACTOR

logger = logging.getLogger(__name__)

HEALTH_STATES = ("alive", "dead", "stalled")
# The stall rule ("stalls" below): stage 0's oldest unanswered frame is overdue once
# it has waited the configured floor, or STALL_ROUND_FACTOR times the round it
# should take (or the longest recent round) if that is longer. A stage found
# stalled is left out of plans for this long, doubling with each stall of the same
# node, up to the maximum.
STALL_QUARANTINE_S = 30.0
STALL_QUARANTINE_MAX_S = 600.0
# A node's earlier stalls are forgotten once it has gone this long after its last
# quarantine without stalling: the next stall starts from STALL_QUARANTINE_S again.
STALL_MEMORY_S = 3600.0
# How the error a stuck stage 0 sets begins (cleared when it computes again).
STAGE0_STUCK = "stage 0 is stuck:"
MESH_STATES = ("waiting", "loading", "serving", "failed")


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    address: str
    device: str
    memory_bytes: int
    speed_hint: float
    frontend: bool
    http_url: str
    joined_at: float
    last_heartbeat_at: float
    health: str = "alive"
    stage_state: str = "idle"
    accepted_term: int = 0
    active_sessions: int = 0
    param_bytes: int = 0
    slice_bytes_done: int = 0
    slice_bytes_total: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    memory_source: str = ""
    # Measured by the stage at its last load (ms per decode step of a few rows), and
    # the mean compute time of its recent frames in the current term.
    layer_ms: float = 0.0
    head_ms: float = 0.0
    step_ms: float = 0.0
    step_frames: int = 0
    # A data link of the stage's loaded pipeline that it reports broken (current
    # term only), and since when (the first heartbeat that said so).
    link_error: str = ""
    link_error_since: float = 0.0
    # Frames of the current term through the stage (its last heartbeat's), and when
    # that heartbeat came.
    progress: FrameProgress = FrameProgress()
    progress_at: float = 0.0
    # When the bytes it reads from its data links were last seen to grow.
    received_at: float = 0.0
    # Found stalled (its data path stuck while it heartbeats): how often, and until
    # when it stays out of plans (health "stalled").
    stalls: int = 0
    stalled_until: float = 0.0

    @property
    def alive(self) -> bool:
        return self.health == "alive"

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(
            node_id=self.node_id,
            address=self.address,
            memory_bytes=self.memory_bytes,
            speed_hint=self.speed_hint,
            frontend=self.frontend,
            memory_measured=self.memory_source == "measured",
            layer_ms=self.layer_ms,
            head_ms=self.head_ms,
        )


@dataclass(frozen=True)
class State:
    nodes: tuple[NodeRecord, ...] = ()  # in order of first join
    term: int = 0
    topology: Plan | None = None
    mesh_state: str = "waiting"
    error: str = ""
    degraded: bool = False
    membership_changed: bool = False
    term_floor: int = 0
    model_id: str = ""
    package_ref: str = ""
    layer_count: int = 0

    def node(self, node_id: str) -> NodeRecord | None:
        for record in self.nodes:
            if record.node_id == node_id:
                return record
        return None

    def is_known(self, node_id: str) -> bool:
        return self.node(node_id) is not None

    def is_assigned(self, node_id: str) -> bool:
        return self.topology is not None and self.topology.stage_of(node_id) is not None

    @property
    def http_url(self) -> str:
        """The frontend's URL: stage 0's when a topology is set, else a frontend node's."""
        if self.topology is not None and self.topology.stages:
            head = self.node(self.topology.stages[0].node_id)
            if head is not None and head.http_url:
                return head.http_url
        return next((n.http_url for n in self.nodes if n.frontend and n.http_url), "")


# ---- events ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelSelected:
    model_id: str
    package_ref: str
    layer_count: int


@dataclass(frozen=True, kw_only=True)
class NodeJoined:
    node_id: str
    address: str
    now: float
    device: str = "cpu"
    memory_bytes: int = 0
    speed_hint: float = 1.0
    frontend: bool = False
    http_url: str = ""
    term: int = 0
    memory_source: str = ""


@dataclass(frozen=True, kw_only=True)
class TermObserved:
    """A term used elsewhere (a persisted one, or one a stage holds): later terms
    must be above it."""

    term: int


@dataclass(frozen=True, kw_only=True)
class HeartbeatReceived:
    node_id: str
    now: float
    term: int = 0
    stage_state: str = ""
    active_sessions: int = 0
    kv_bytes: int = 0
    prefix_bytes: int = 0
    step_ms: float = 0.0
    step_frames: int = 0
    link_error: str = ""
    progress: FrameProgress = FrameProgress()


@dataclass(frozen=True, kw_only=True)
class HeartbeatsChecked:
    now: float
    timeout_s: float
    # Dead nodes silent for longer than this are forgotten (0: kept forever).
    forget_after_s: float = 0.0
    # The stall rule's floor in seconds (0: the rule is off).
    stall_timeout_s: float = 0.0
    # Silence (and waits, and link reports) count only from this time on: when the
    # coordinator itself was stopped or starved (its own checks ran late), what it
    # did not hear meanwhile says nothing about the stages.
    judged_from: float = -math.inf


@dataclass(frozen=True, kw_only=True)
class PlanFailed:
    """The planner refused (the model does not fit the alive nodes)."""

    error: str


@dataclass(frozen=True, kw_only=True)
class LoadStarted:
    term: int
    plan: Plan


@dataclass(frozen=True, kw_only=True)
class StageReady:
    node_id: str
    param_bytes: int
    term: int | None = None
    now: float | None = None  # when the Ready reply was received
    # The stage's step probe (0: not measured; an earlier figure is kept then).
    layer_ms: float = 0.0
    head_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SliceProgress:
    """A node's Inventory during a load: bytes of its slice present and needed."""

    node_id: str
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True, kw_only=True)
class LoadFailed:
    term: int
    error: str


@dataclass(frozen=True, kw_only=True)
class LoadSucceeded:
    term: int


@dataclass(frozen=True, kw_only=True)
class NodeLeft:
    node_id: str


@dataclass(frozen=True, kw_only=True)
class NodeUnreachable:
    """The coordinator could not connect to a node's advertised address before a
    load: it is left out of plans for a quarantine, as a stalled stage is."""

    node_id: str
    error: str
    now: float


Event = (
    ModelSelected
    | NodeJoined
    | HeartbeatReceived
    | HeartbeatsChecked
    | PlanFailed
    | LoadStarted
    | StageReady
    | LoadFailed
    | LoadSucceeded
    | NodeLeft
    | NodeUnreachable
    | TermObserved
    | SliceProgress
)


# ---- queries --------------------------------------------------------------------


def alive_nodes(state: State) -> tuple[NodeRecord, ...]:
    """Alive nodes in join order."""
    return tuple(n for n in state.nodes if n.alive)


def joined_nodes(state: State) -> tuple[NodeRecord, ...]:
    """Nodes that joined and heartbeat: the alive ones and those left out of plans for
    a quarantine (a stall, a load they failed). What ``--min-stages`` counts: a
    joined node that cannot serve for now does not hold back the first load."""
    return tuple(n for n in state.nodes if n.alive or n.health == "stalled")


def planner_nodes(state: State) -> list[NodeCapacity]:
    """What the planner needs from every alive node, in join order."""
    return [n.capacity() for n in alive_nodes(state)]


def needs_replan(state: State) -> bool:
    if not alive_nodes(state):
        return False
    if state.mesh_state == "waiting":
        return True
    return state.mesh_state == "failed" and (state.degraded or state.membership_changed)


def undersized(state: State, want_stages: int) -> bool:
    """Serving on fewer stages than ``want_stages`` while more alive nodes exist than
    the pipeline uses (a failed stage came back, or a new one joined)."""
    if state.mesh_state != "serving" or state.topology is None:
        return False
    current = len(state.topology.stages)
    return current < want_stages and len(alive_nodes(state)) > current


def frontend_idle(state: State) -> bool:
    """Stage 0 reported no active sessions in its last heartbeat."""
    if state.topology is None or not state.topology.stages:
        return False
    head = state.node(state.topology.stages[0].node_id)
    return head is not None and head.active_sessions == 0


def frontend_missing(state: State, expect_frontend: bool = False) -> bool:
    """No frontend node is alive while one is known (a dead one is kept: stage 0 of
    every pipeline) or expected (``expect_frontend``: ``up`` starts it itself, or
    the mesh a restarted coordinator takes back served HTTP): nothing is planned
    then, since a pipeline whose stage 0 has no frontend serves nobody."""
    if not (expect_frontend or any(n.frontend for n in state.nodes)):
        return False
    return not any(n.frontend for n in alive_nodes(state))


def waiting_for(
    state: State,
    *,
    min_stages: int,
    served_once: bool,
    retry_in_s: float | None = None,
    expect_frontend: bool = False,
    gave_up: str | None = None,
) -> str:
    """What the mesh waits for before it serves (or grows back), for operators; empty
    when it serves at the size asked for. ``retry_in_s``: seconds to the next load
    attempt after a failure."""
    alive = alive_nodes(state)
    if gave_up:
        return "nothing: the coordinator gave up (see error)"
    if state.mesh_state == "loading":
        return f"the stages to load term {state.term}"
    if state.mesh_state == "serving":
        if undersized(state, min_stages):
            return (
                f"stage 0 to be idle, to plan again on {len(alive)} alive nodes "
                f"(serving on {len(state.topology.stages)}, --min-stages {min_stages})"
            )
        return ""
    if frontend_missing(state, expect_frontend):
        if any(n.frontend for n in state.nodes):
            return "the frontend stage (stage 0) to rejoin"
        return "the frontend stage (stage 0) to join (a node with --frontend)"
    needed = 1 if served_once else min_stages
    joined = len(joined_nodes(state))
    if joined < needed or not alive:
        return (
            f"{max(1, needed - joined)} more stage(s) to join ({len(alive)} alive, "
            f"--min-stages {min_stages})"
        )
    if state.mesh_state == "failed":
        when = f" in {retry_in_s:.0f} s" if retry_in_s is not None else ""
        return f"the next load attempt{when}"
    return "the first load to start"


def next_term(state: State) -> int:
    """The term of the next load: above every term this coordinator used or heard of."""
    reported = max((n.accepted_term for n in state.nodes), default=0)
    return max(state.term, state.term_floor, reported) + 1


# ---- transitions ------------------------------------------------------------------


def apply(state: State, event: Event) -> State:
    """The state after ``event``. Stale load events (an older term) change nothing."""
    match event:
        case ModelSelected():
            return replace(
                state,
                model_id=event.model_id,
                package_ref=event.package_ref,
                layer_count=event.layer_count,
            )
        case NodeJoined():
            return _node_joined(state, event)
        case HeartbeatReceived():
            return _heartbeat(state, event)
        case HeartbeatsChecked():
            return _check_heartbeats(state, event)
        case PlanFailed():
            return replace(
                state,
                mesh_state="failed",
                error=event.error,
                topology=None,
                degraded=False,
                membership_changed=False,
            )
        case LoadStarted():
            return _load_started(state, event)
        case StageReady():
            if event.term is not None and event.term != state.term:
                return state
            changes: dict[str, object] = {"param_bytes": event.param_bytes, "stage_state": "loaded"}
            node = state.node(event.node_id)
            if event.layer_ms > 0 and node is not None:
                changes.update(_probe_figures(node, event.layer_ms, event.head_ms))
            if event.now is not None and node is not None:
                # A Ready reply is proof of life: a stage busy loading its layers may
                # have been too busy to heartbeat meanwhile.
                changes["last_heartbeat_at"] = max(node.last_heartbeat_at, event.now)
            return _update_node(state, event.node_id, **changes)
        case LoadFailed():
            if event.term != state.term or state.mesh_state not in ("loading", "serving"):
                return state
            return replace(state, mesh_state="failed", error=event.error, topology=None)
        case LoadSucceeded():
            if event.term != state.term or state.mesh_state != "loading":
                return state
            return replace(state, mesh_state="serving", error="")
        case SliceProgress():
            return _update_node(
                state,
                event.node_id,
                slice_bytes_done=event.bytes_done,
                slice_bytes_total=event.bytes_total,
            )
        case TermObserved():
            return replace(state, term_floor=max(state.term_floor, event.term))
        case NodeUnreachable():
            record = state.node(event.node_id)
            if record is None:
                return state
            return _stall(state, record, f"node {event.node_id}: {event.error}", event.now)
        case NodeLeft():
            if not state.is_known(event.node_id):
                return state
            return _remove_node(state, event.node_id, "left the mesh")
    raise InvalidRequest(f"unknown coordinator event {type(event).__name__}")


def _node_joined(state: State, event: NodeJoined) -> State:
    if not event.node_id or not event.address:
        raise InvalidRequest("a joining node must give a node_id and an address (host:port)")
    known = state.node(event.node_id)
    if known is None:
        record = NodeRecord(
            node_id=event.node_id,
            address=event.address,
            device=event.device,
            memory_bytes=event.memory_bytes,
            memory_source=event.memory_source,
            speed_hint=event.speed_hint,
            frontend=event.frontend,
            http_url=event.http_url,
            joined_at=event.now,
            last_heartbeat_at=event.now,
            received_at=event.now,
            accepted_term=event.term,
        )
        logger.debug("node %s joined from %s (%s)", event.node_id, event.address, event.device)
        state = _forget_replaced(state, event.node_id, event.address)
        return replace(state, nodes=state.nodes + (record,), membership_changed=True)
    known = state.node(event.node_id)
    moved = known is not None and known.address != event.address
    if moved and known.alive:
        # Another process took the id while the one it named still beats (two stages
        # given one --node-id, or a stage moved to another address): the later wins.
        logger.warning(
            "node %s joined from %s while the process at %s still held this node id: the "
            "later one takes it. If these are two stages, give each its own --node-id",
            event.node_id,
            event.address,
            known.address,
        )
        why = f"its node id was taken by a process at {event.address}"
    else:
        logger.info("node %s joined again from %s", event.node_id, event.address)
        why = (
            f"joined again from another address ({event.address}, was {known.address})"
            if moved
            else "joined again (its process restarted)"
        )
    after = _degrade_if_assigned(state, event.node_id, why)
    return replace(
        _update_node(
            after,
            event.node_id,
            address=event.address,
            device=event.device,
            memory_bytes=event.memory_bytes,
            memory_source=event.memory_source,
            speed_hint=event.speed_hint,
            frontend=event.frontend,
            http_url=event.http_url,
            last_heartbeat_at=event.now,
            health="alive",
            stage_state="idle",
            accepted_term=event.term,
            active_sessions=0,
            param_bytes=0,
        ),
        membership_changed=True,
    )


def _forget_replaced(state: State, node_id: str, address: str) -> State:
    """Forget the nodes not alive at ``address``, which a new node id joins from: the
    process there now is another (a stage restarted with another --node-id), so the
    old record could only ever come back from elsewhere, as a join of its own."""
    for old in [n for n in state.nodes if n.address == address and not n.alive]:
        logger.info(
            "forgetting node %s (%s): node %s joined from its address %s",
            old.node_id,
            old.health,
            node_id,
            address,
        )
        state = _remove_node(state, old.node_id, f"was replaced by {node_id}")
    return state


def _remove_node(state: State, node_id: str, why: str) -> State:
    """``node_id`` leaves the registry (its stage, if assigned, fails the mesh over)."""
    after = _degrade_if_assigned(state, node_id, why)
    remaining = tuple(n for n in after.nodes if n.node_id != node_id)
    return replace(after, nodes=remaining, membership_changed=True)


def _heartbeat(state: State, event: HeartbeatReceived) -> State:
    known = state.node(event.node_id)
    if known is None:
        return state
    # A stalled node heartbeats on; it stays out of plans until its quarantine ends.
    stalled = known.health == "stalled" and event.now < known.stalled_until
    changes: dict[str, object] = {
        "last_heartbeat_at": event.now,
        "health": "stalled" if stalled else "alive",
        "accepted_term": event.term,
        "active_sessions": event.active_sessions,
        "kv_bytes": event.kv_bytes,
        "prefix_bytes": event.prefix_bytes,
    }
    if event.stage_state:
        changes["stage_state"] = event.stage_state
    if event.term == state.term and event.stage_state == "serving":
        # Frames of this term only: a stage between a Claim and its Load still
        # remembers the frames of its previous term.
        changes["step_ms"] = event.step_ms
        changes["step_frames"] = event.step_frames
    broken = event.link_error if event.term == state.term else ""
    changes["link_error"] = broken
    changes["link_error_since"] = (known.link_error_since or event.now) if broken else 0.0
    changes["progress"] = event.progress if event.term == state.term else FrameProgress()
    changes["progress_at"] = event.now
    if event.progress.received != known.progress.received:
        changes["received_at"] = event.now
    after = _update_node(state, event.node_id, **changes)
    if state.mesh_state == "serving" and event.term > state.term:
        # A Claim from elsewhere (another coordinator on the same stages) fenced this
        # stage off: its layers are gone, and frames of this term would wait on it.
        after = _degrade_if_assigned(
            after,
            event.node_id,
            f"took a claim of term {event.term}, above the mesh's {state.term} (another "
            "coordinator claimed it)",
        )
    if known.alive or stalled:
        return after
    # A dead (or stalled) node is never assigned (its stage was dropped when it was
    # lost), so it comes back unassigned and only a new plan can use it again.
    if known.health == "stalled":
        logger.info("node %s: its stall quarantine is over; it may serve again", event.node_id)
    else:
        logger.info("node %s is alive again (unassigned)", event.node_id)
    return replace(after, membership_changed=True)


def _check_heartbeats(state: State, event: HeartbeatsChecked) -> State:
    after = state
    for record in state.nodes:
        silent_s = event.now - record.last_heartbeat_at
        if not record.alive and 0 < event.forget_after_s < silent_s and not record.frontend:
            # A dead frontend node is kept: while it is known, no pipeline is loaded
            # without a frontend (forgotten, any node could be planned as a stage 0
            # that serves no API). Another node joining from its address replaces it.
            logger.info("forgetting node %s: silent for %.0f s", record.node_id, silent_s)
            after = replace(after, nodes=tuple(n for n in after.nodes if n is not record))
            continue
        judged_s = event.now - max(record.last_heartbeat_at, event.judged_from)
        if record.health == "dead" or judged_s <= event.timeout_s:
            continue
        logger.warning(
            "node %s (%s) missed heartbeats for %.1f s; marking it dead",
            record.node_id,
            record.address,
            silent_s,
        )
        reason = f"missed heartbeats for {silent_s:.1f} s (timeout {event.timeout_s:g} s)"
        after = _degrade_if_assigned(after, record.node_id, reason)
        # Its last report says nothing of now: it holds no sessions and no KV the
        # mesh can count on (status and the metrics showed them until it came back).
        dead = _update_node(
            after, record.node_id, health="dead", active_sessions=0, kv_bytes=0, prefix_bytes=0
        )
        after = replace(dead, membership_changed=True)
    return _check_stalls(_check_links(after, event), event)


def _check_links(state: State, event: HeartbeatsChecked) -> State:
    """Plan again when a stage of the serving pipeline has reported a broken data link
    for a heartbeat timeout while every stage stays alive: frames can no longer pass
    (or answers come back), and only a new load opens new links. A peer that died
    is found by its missed heartbeats within the same timeout, and that failure is
    handled as such first (the report then concerns a pipeline that is gone)."""
    if state.mesh_state != "serving" or state.topology is None:
        return state
    for stage in state.topology.stages:
        record = state.node(stage.node_id)
        if record is None or not record.link_error or record.link_error_since <= 0:
            continue
        if event.now - max(record.link_error_since, event.judged_from) < event.timeout_s:
            continue
        what = f"reports a broken data link ({record.link_error})"
        return _degrade_if_assigned(state, record.node_id, what)
    return state


def _check_stalls(state: State, event: HeartbeatsChecked) -> State:
    """Find a stage whose data path is stuck while it still heartbeats (a hung
    thread or device, a port that drops the data links' packets) and plan again
    without it.

    Stage 0 says which frame has waited longest for its answer; the frame is
    overdue after the larger of ``event.stall_timeout_s`` and ``STALL_ROUND_FACTOR``
    times the round it should take (or the longest recent round). Frames pass the
    stages in order and every stage reports the highest frame id it has finished,
    so the first stage that has not finished the overdue frame holds it (or the
    link into it does); when every stage has finished it, its answer is stuck on
    the way back to stage 0 and the last stage (whose return link that is) is
    blamed. The stage blamed is left out of plans for ``STALL_QUARANTINE_S``,
    doubling with each stall of the same node. A frame stuck in stage 0's own
    compute cannot be planned around (the frontend is stage 0; its requests end
    after their round timeout): the mesh's error says so until it computes again."""
    if event.stall_timeout_s <= 0 or state.mesh_state != "serving" or state.topology is None:
        return state
    stages = state.topology.stages
    head = state.node(stages[0].node_id)
    if head is None or head.accepted_term != state.term or not head.progress.waiting_frame:
        return _stage0_unstuck(state)
    waiting = head.progress
    waited = waiting.waiting_s + max(0.0, event.now - max(head.progress_at, event.judged_from))
    expected = max(_expected_round(state, waiting.waiting_compute_s), waiting.longest_round_s)
    deadline = max(event.stall_timeout_s, STALL_ROUND_FACTOR * expected)
    frame = waiting.waiting_frame
    if waited < deadline:
        return _stage0_unstuck(state)
    if waiting.done < frame:
        # Nothing to plan around, but the operator must know: the mesh looks fine
        # from every heartbeat while no request progresses.
        error = (
            f"{STAGE0_STUCK} {head.node_id} at {head.address} has not computed frame "
            f"{frame} (stall deadline {deadline:.0f} s): its frame processing is stuck "
            "(a hung device call or thread); its requests end after their round "
            "timeout. Restart that process"
        )
        if state.error != error:
            logger.error("%s", error)
            return replace(state, error=error)
        return state
    waited_for = (
        f"stage 0 has waited {waited:.1f} s for its answer (stall deadline {deadline:.1f} s)"
    )
    for previous, stage in zip(stages, stages[1:], strict=False):
        record = state.node(stage.node_id)
        if record is not None and record.progress.done < frame:
            if _receiving(record, event, deadline):
                return state
            what = (
                f"has not finished frame {frame}, which stage {previous.stage_index} passed "
                f"on; {waited_for}: its frame processing, or the data link into it, is stuck"
            )
            return _stall(state, record, what, event.now)
    last = state.node(stages[-1].node_id)
    if last is None or _receiving(head, event, deadline):
        return state
    what = f"finished frame {frame}, but {waited_for}: the return link to stage 0 is stuck"
    return _stall(state, last, what, event.now)


def _expected_round(state: State, compute_s: float) -> float:
    """The round a frame should take, from stage 0's own compute time for it: each
    stage takes that times its cost over stage 0's, at least 1 (the planner gives
    the stages about equal times; a slower device, or a split that memory forced,
    takes longer). A stage's cost is its load-time probe (one layer times its
    layers, plus the LM head on the last stage), else its measured step time; the
    stage count times it when neither is known."""
    stages = state.topology.stages if state.topology is not None else ()
    if not stages:
        return compute_s
    last = stages[-1].node_id
    records = [state.node(s.node_id) for s in stages]
    probes = [
        r.layer_ms * len(s.layer_range) + (r.head_ms if s.node_id == last else 0.0)
        if r is not None
        else 0.0
        for r, s in zip(records, stages, strict=True)
    ]
    steps = [r.step_ms if r is not None else 0.0 for r in records]
    for costs in (probes, steps):
        if min(costs) > 0.0:
            return compute_s * sum(max(1.0, c / costs[0]) for c in costs)
    return compute_s * len(stages)


def _stage0_unstuck(state: State) -> State:
    """Clear the error a stuck stage 0 left once nothing is overdue."""
    if state.error.startswith(STAGE0_STUCK):
        logger.info("stage 0 computes frames again")
        return replace(state, error="")
    return state


def _receiving(record: NodeRecord, event: HeartbeatsChecked, deadline: float) -> bool:
    """Whether ``record``'s process read bytes from its data links within the last
    ``deadline`` seconds: a frame on its way over a slow link, not a stuck stage."""
    return event.now - max(record.received_at, event.judged_from) < deadline


def _stall(state: State, record: NodeRecord, what: str, now: float) -> State:
    """Fail the mesh over ``record``'s stage and keep that node out of plans for
    its quarantine."""
    # Stalls long past (STALL_MEMORY_S after the last quarantine ended) are forgiven.
    stalls = record.stalls if now - record.stalled_until < STALL_MEMORY_S else 0
    quarantine = min(STALL_QUARANTINE_MAX_S, STALL_QUARANTINE_S * 2**stalls)
    what = f"{what}; the node is left out of plans for {quarantine:.0f} s"
    after = _degrade_if_assigned(state, record.node_id, what)
    after = _update_node(
        after,
        record.node_id,
        health="stalled",
        stalls=stalls + 1,
        stalled_until=now + quarantine,
    )
    return replace(after, membership_changed=True)


def _load_started(state: State, event: LoadStarted) -> State:
    if event.term <= state.term:
        raise StaleTerm(
            f"load term {event.term} is not above the current term {state.term}; "
            "start every load with next_term(state)"
        )
    for stage in event.plan.stages:
        record = state.node(stage.node_id)
        if record is None or not record.alive:
            raise InvalidRequest(
                f"the plan puts stage {stage.stage_index} on node {stage.node_id}, which is "
                f"{'not joined' if record is None else 'dead'}; plan again from alive_nodes()"
            )
    if state.layer_count and event.plan.layer_count != state.layer_count:
        raise InvalidRequest(
            f"the plan covers {event.plan.layer_count} layers but the model has "
            f"{state.layer_count}; plan again with the model's footprint"
        )
    nodes = tuple(
        replace(
            n,
            param_bytes=0,
            step_ms=0.0,
            step_frames=0,
            link_error="",
            link_error_since=0.0,
            progress=FrameProgress(),
        )
        for n in state.nodes
    )
    return replace(
        state,
        nodes=nodes,
        term=event.term,
        topology=event.plan,
        mesh_state="loading",
        error="",
        degraded=False,
        membership_changed=False,
    )


def _probe_figures(node: NodeRecord, layer_ms: float, head_ms: float) -> dict[str, float]:
    """A node's step probe, averaged with its earlier ones (one probe on a busy
    machine is noisy); a head figure stays from the load that measured one."""
    layer = (node.layer_ms + layer_ms) / 2 if node.layer_ms > 0 else layer_ms
    head = node.head_ms
    if head_ms > 0:
        head = (node.head_ms + head_ms) / 2 if node.head_ms > 0 else head_ms
    return {"layer_ms": layer, "head_ms": head}


def _update_node(state: State, node_id: str, **changes: object) -> State:
    if not state.is_known(node_id):
        return state
    nodes = tuple(replace(n, **changes) if n.node_id == node_id else n for n in state.nodes)
    return replace(state, nodes=nodes)


def _degrade_if_assigned(state: State, node_id: str, what: str) -> State:
    """Fail the mesh when ``node_id`` holds a stage of the current topology."""
    stage = state.topology.stage_of(node_id) if state.topology is not None else None
    if stage is None:
        return state
    error = (
        f"stage {stage.stage_index} ({stage.node_id} at {stage.address}, layers "
        f"{stage.layer_range}) {what}; the mesh is degraded and will be planned again "
        "with the remaining nodes"
    )
    logger.error("%s", error)
    return replace(state, mesh_state="failed", degraded=True, error=error, topology=None)
