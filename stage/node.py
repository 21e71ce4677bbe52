"""A stage node's state and behaviour: terms, slice preparation, load, and the
frame worker that runs the engine and routes its output. Servicers (stage/servicers.py)
call into this class with decoded messages only."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from mesh.codec import (
    ClaimRequest,
    FileInventory,
    HeartbeatRequest,
    InventoryReply,
    PrepareRequest,
    Ready,
    StageLoadRequest,
    WireDType,
    frame_to_proto,
    result_to_proto,
)
from mesh.errors import (
    CapacityExceeded,
    InvalidRequest,
    LinkUnreachable,
    LoadCancelled,
    MeshError,
    StaleTerm,
    Unavailable,
    out_of_memory,
)
from mesh.frames import (
    ErrorInfo,
    Frame,
    FrameAck,
    FrameProgress,
    FrameResult,
    Segment,
    SegmentKind,
    SegmentResult,
)
from mesh.gcpause import settle, thaw
from mesh.grammar import TokenGrammars
from mesh.heap import HeapTrimmer
from mesh.package.manifest import PackageManifest
from mesh.package.remote import RemotePackageSource
from mesh.package.resolver import SliceInventory, SliceResolver
from mesh.runtime import load_stage_runtime
from mesh.runtime.probe import probe_step
from mesh.runtime.skeleton import resolve_device, resolve_dtype
from mesh.runtime.stage import RuntimeStats
from mesh.threads import NamedThread
from mesh.types import DEFAULT_PREFIX_BYTES, check_term
from stage.engine import StageEngine
from stage.hardware import RecentSteps
from stage.links import (
    CONNECT_TIMEOUT_S,
    DataLink,
    open_forward_link,
    open_return_link,
    peer_serving,
)
from stage.metrics import StageMetrics
from stage.tcp_data import received_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_FRAME_TOKENS = 8192
IDLE_SWEEP_S = 5.0
# The exit status of a stage that ends itself because a frame is stuck
# (EX_SOFTWARE): its service manager starts it again.
STUCK_EXIT_STATUS = 70
# Stage 0 remembers its compute time for this many of its latest frames (what the
# round of the frame it waits on should take, for the coordinator's stall rule).
COMPUTE_TIMES_KEPT = 64
# While the coordinator cannot be reached, a stage whose data link broke tries to
# open it again this often, asking its peer for at most REPAIR_PROBE_TIMEOUT_S.
REPAIR_INTERVAL_S = 1.0
REPAIR_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    cache_dir: Path
    device: str = "cpu"
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frame_tokens: int = DEFAULT_MAX_FRAME_TOKENS
    allowed_wire_dtypes: tuple[WireDType, ...] = tuple(WireDType)
    # Added to every outgoing hop (Forward and Return) to emulate a network; 0 = off.
    inject_delay_ms: float = 0.0
    # Run decode steps through torch.compile (mesh-stage join --compile).
    compile: bool = False
    # Replay decode steps as CUDA graphs on a CUDA device (mesh-stage join --cuda-graphs).
    cuda_graphs: bool = False
    # Process a frame that finds the stage idle on the thread that received it.
    inline_frames: bool = True
    # Bytes of kept prefixes (the prefix cache) this stage holds at most
    # (mesh-stage join --prefix-cache-mb).
    prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES
    # Exit when one frame has been processing this long (0: never;
    # mesh-stage join --stuck-exit-after).
    stuck_exit_after_s: float = 0.0
    # Freeze what a load leaves alive out of the garbage collector's way
    # (mesh/gcpause.py). The processes take [stage] gc_freeze (on by default); off
    # here for nodes built inside another program (tests) whose objects it would freeze.
    gc_freeze: bool = False


def measures_step(frame: Frame) -> bool:
    """Whether ``frame``'s compute time counts in the step time the coordinator's
    rebalance compares (``RecentSteps``): a decode or verify step, what each stage's
    load-time probe measures too. A frame with prompt rows does not: its rows cost
    the stages in another ratio (the last stage's head reads one row of a prompt),
    so a burst of them (every running request re-read after a failover) would tilt
    the measured ratio, and the next plan, towards the prompts."""
    kinds = [segment.kind for segment in frame.segments if segment.kind.computes]
    return bool(kinds) and SegmentKind.PREFILL not in kinds


@dataclass(frozen=True)
class WaitingFrame:
    """Stage 0's oldest frame of ``term`` still waiting for an answer: its id, when it
    was sent (``time.perf_counter()``), and the longest recent round in seconds."""

    term: int
    frame_id: int
    sent_at: float
    longest_round_s: float


@dataclass
class _Work:
    frame: Frame
    received_at: float
    ack: Callable[[FrameAck], None] | None = None


@dataclass
class LoadedStage:
    """Everything that exists only while a topology is loaded."""

    request: StageLoadRequest
    engine: StageEngine
    package_dir: Path
    forward: DataLink | None = None
    returns: DataLink | None = None
    loaded_at: float = field(default_factory=time.monotonic)
    # This load's data links that are broken now ("forward", "return") and why
    # (heartbeats carry it: the coordinator plans again, and the new load opens new
    # links; while no coordinator can be reached the stage opens them again itself).
    broken_links: dict[str, str] = field(default_factory=dict)
    # The links a thread of this load is opening again now.
    repairing: set[str] = field(default_factory=set)
    # The highest frame id of this load's term the stage has finished, and (stage 0)
    # its compute time for its latest frames, by frame id: heartbeats carry them.
    frames_done: int = 0
    compute_s: OrderedDict[int, float] = field(default_factory=OrderedDict)

    @property
    def link_error(self) -> str:
        """Why this load's data links are broken ("": they are not)."""
        return "; ".join(self.broken_links.values())

    def finished(self, frame_id: int, seconds: float) -> None:
        """Frame ``frame_id`` of this term has left the stage after ``seconds``."""
        self.frames_done = max(self.frames_done, frame_id)
        if self.request.is_first:
            self.compute_s[frame_id] = seconds
            while len(self.compute_s) > COMPUTE_TIMES_KEPT:
                self.compute_s.popitem(last=False)


class StageNode:
    """One stage: control state machine plus the frame worker."""

    def __init__(
        self,
        settings: NodeSettings,
        address: str,
        remote: RemotePackageSource | None = None,
        metrics: StageMetrics | None = None,
    ) -> None:
        """``remote`` serves packages named by a path this host cannot read (the
        coordinator, for a worker without a shared file system); ``metrics`` holds the
        process's Prometheus series (a registry of its own by default)."""
        self.settings = settings
        self.address = address
        self.resolver = SliceResolver(settings.cache_dir, remote=remote)
        self.term = 0
        self.coordinator_id = ""
        self.state = "idle"
        self.loaded: LoadedStage | None = None
        self._lock = threading.RLock()
        # The term of the Load in progress (0: none) and whether a Release or a newer
        # Claim has given it up: read and set without the lock, which the Load holds
        # while it waits for its neighbours.
        self._loading_term = 0
        self._load_cancelled = threading.Event()
        # Frames waiting to be processed, in arrival order, and whether one is being
        # processed now (by the worker, or inline by the thread that received it):
        # one frame at a time, in order.
        self._frames = threading.Condition()
        self._pending: deque[_Work | None] = deque()
        self._busy = False
        self._result_sink: Callable[[FrameResult], None] | None = None
        self._stopping = threading.Event()
        self._listeners: list[Callable[[LoadedStage | None], None]] = []
        self._broken_listeners: list[Callable[[str], None]] = []
        self._reopened_listeners: list[Callable[[LoadedStage, str], None]] = []
        self._repair_lock = threading.Lock()
        self._on_newer_term: Callable[[], None] | None = None
        # Stage 0's frame that waits longest for an answer (its scheduler sets it).
        self.waiting: WaitingFrame | None = None
        # Requests the frontend on this node serves now (stage 0 sets it): a Claim
        # ``only_if_idle`` is refused while there are any.
        self.busy: Callable[[], int] | None = None
        # Seconds the coordinator has been unreachable (0: it answered the last call);
        # the process's membership sets it. Stage 0's local stall rule asks it.
        self.coordinator_outage: Callable[[], float] = lambda: 0.0
        # The frame being processed now and since when (the stuck-frame watchdog).
        self._processing: tuple[int, float] | None = None
        self._exit: Callable[[int], None] = os._exit
        self.metrics = metrics if metrics is not None else StageMetrics()
        self.metrics.watch(self)
        # Compute time of the last frames, for the coordinator's rebalance.
        self.steps = RecentSteps()
        # The last stage's grammar compiler, kept across loads of the same package:
        # its tokenizer takes a second or more to build, inside a frame's processing.
        self._grammars: TokenGrammars | None = None
        self._worker = NamedThread(target=self._work_loop, name="stage-worker", daemon=True)
        self._worker.start()
        # Frames, loads and releases leave freed memory in the allocator's heaps; the
        # sweep hands it back once the stage is idle (mesh/heap.py).
        self.heap = HeapTrimmer()
        self._sweeper = NamedThread(target=self._sweep_loop, name="idle-sweep", daemon=True)
        self._sweeper.start()
        if settings.stuck_exit_after_s > 0:
            NamedThread(target=self._stuck_loop, name="stuck-watch", daemon=True).start()

    # ---- stage-0 hooks -----------------------------------------------------------

    def set_result_sink(self, sink: Callable[[FrameResult], None]) -> None:
        """Where FrameResults for this node go when it is stage 0 (the engine core)."""
        self._result_sink = sink

    def on_load_change(self, listener: Callable[[LoadedStage | None], None]) -> None:
        self._listeners.append(listener)

    def on_downstream_broken(self, listener: Callable[[str], None]) -> None:
        """``listener(why)`` runs when the loaded stage's link to the next stage breaks
        (nothing it is sent can go on until a new pipeline is loaded)."""
        self._broken_listeners.append(listener)

    def deliver_result(self, result: FrameResult) -> None:
        """A FrameResult that reached stage 0 over the Return stream."""
        if self._result_sink is not None:
            self._result_sink(result)

    def submit(self, frame: Frame) -> None:
        """Queue a frame from stage 0's own engine core."""
        self._enqueue(_Work(frame, time.monotonic()))

    def amend(self, frame_id: int, more: Callable[[], Sequence[Segment]]) -> bool:
        """Add the segments ``more()`` returns to frame ``frame_id`` of stage 0's engine
        core while the worker has not started it; False (and ``more`` not called) once
        it has. ``more`` runs under the lock the worker takes a frame with, so the
        segments it commits to always travel."""
        with self._frames:
            work = next(
                (w for w in self._pending if w is not None and w.frame.frame_id == frame_id),
                None,
            )
            if work is None:
                return False
            segments = tuple(more())
            if segments:
                frame = work.frame
                work.frame = replace(frame, segments=frame.segments + segments)
            return bool(segments)

    # ---- control -------------------------------------------------------------------

    def claim(self, request: ClaimRequest) -> int:
        check_term(request.term, "Claim")
        self._cancel_load(request.term, newer_only=True)
        with self._lock:
            if request.term < self.term:
                raise StaleTerm(
                    f"node {self.settings.node_id} accepted term {self.term}; "
                    f"claim with term {request.term} refused",
                    held_term=self.term,
                )
            if request.term > self.term and self.loaded is not None:
                running = self.busy() if request.only_if_idle and self.busy else 0
                if running:
                    raise CapacityExceeded(
                        f"node {self.settings.node_id} serves {running} request(s) of term "
                        f"{self.term}; term {request.term} was to be loaded only while it "
                        "is idle"
                    )
                logger.info("term %s fences off term %s: releasing", request.term, self.term)
                self._release_locked("fenced by a newer term")
            self.term = request.term
            self.coordinator_id = request.coordinator_id
            if self.loaded is None:
                self.state = "claimed"
            return self.term

    def _check_term(self, term: int, call: str) -> None:
        if term != self.term:
            raise StaleTerm(
                f"{call} with term {term} refused by node {self.settings.node_id}: "
                f"it holds term {self.term}; claim it first",
                held_term=self.term,
            )

    def prepare(self, request: PrepareRequest) -> None:
        with self._lock:
            self._check_term(request.term, "Prepare")
            self.resolver.start(
                request.package_ref, request.layer_range, expected=request.manifest_sha256
            )
            if self.loaded is None:
                self.state = "preparing"

    def inventory(self, term: int) -> InventoryReply:
        with self._lock:
            self._check_term(term, "Inventory")
            inv = self.resolver.inventory()
        return inventory_reply(term, inv)

    def _cancel_load(self, term: int, newer_only: bool) -> None:
        """Give up the Load in progress when ``term`` ends it (a Release of its term or
        a newer one; a Claim of a newer term): its wait for a neighbour that will not
        answer (a stage killed as the attempt loaded) ends at once instead of holding
        this node's lock, and with it the Release, for the link's 10 s."""
        loading = self._loading_term
        if loading and (term > loading or (term == loading and not newer_only)):
            self._load_cancelled.set()

    def load(self, request: StageLoadRequest) -> Ready:
        try:
            return self._load(request)
        finally:
            self._loading_term = 0

    def _load(self, request: StageLoadRequest) -> Ready:
        with self._lock:
            self._check_term(request.term, "Load")
            self._load_cancelled.clear()
            self._loading_term = request.term
            started = time.perf_counter()
            package_dir = self._ready_slice(request)
            device = request.device or self.settings.device
            dtype = request.torch_dtype or "auto"
            # What a load could refuse at once is checked before the layers being
            # served are let go.
            resolve_device(device)
            if dtype != "auto":
                resolve_dtype(dtype)
            if self.loaded is not None:
                self._release_locked("reloaded")
            runtime = load_stage_runtime(
                package_dir,
                request.layer_range,
                device=device,
                dtype=dtype,
                max_sessions=request.max_sessions or 64,
                max_tokens_per_session=request.max_tokens_per_session or None,
                compile=self.settings.compile,
                cuda_graphs=self.settings.cuda_graphs,
            )
            runtime.set_prefix_bytes(self.settings.prefix_cache_bytes)
            probe = probe_step(runtime)
            self.steps.clear()
            grammars = self._grammars_for(package_dir) if runtime.is_last else None
            if grammars is not None:
                grammars.warm(runtime.vocab_size)
            engine = StageEngine(runtime, request.stage_index, request.term, grammars)
            loaded = LoadedStage(request=request, engine=engine, package_dir=package_dir)
            try:
                if request.downstream is not None:
                    loaded.forward = self._open_link(loaded, "forward", self._load_cancelled.is_set)
                if not request.is_first:
                    loaded.returns = self._open_link(loaded, "return", self._load_cancelled.is_set)
            except MeshError as error:
                for link in (loaded.forward, loaded.returns):
                    if link is not None:
                        link.close()
                if isinstance(error, LoadCancelled):
                    raise
                raise LinkUnreachable(
                    f"{error.message}. This stage ({self.address}) must reach the address "
                    "its neighbours advertise: check routes and firewalls between the hosts, "
                    "or give that node an --advertise address this host can reach",
                    "forward" if loaded.forward is None and request.downstream else "return",
                ) from error
            self.loaded = loaded
            self.state = "serving"
            self.heap.worked()  # loading leaves its buffers (and any old slice) freed
            load_ms = (time.perf_counter() - started) * 1000.0
            logger.info(
                "stage %s/%s loaded layers %s (term %s) in %.0f ms; downstream %s",
                request.stage_index,
                request.stage_count,
                request.layer_range,
                request.term,
                load_ms,
                request.downstream.address if request.downstream else "none (last stage)",
            )
        for listener in self._listeners:
            listener(loaded)
        if self.settings.gc_freeze:
            settle(f"loading layers {request.layer_range} (term {request.term})")
        return Ready(
            term=request.term,
            data_endpoint=self.address,
            param_bytes=runtime.param_bytes,
            load_ms=load_ms,
            layer_ms=probe.layer_ms,
            head_ms=probe.head_ms,
        )

    def _ready_slice(self, request: StageLoadRequest) -> Path:
        inv = self.resolver.inventory()
        if inv.state != "ready" or inv.layer_range != request.layer_range:
            raise InvalidRequest(
                f"node {self.settings.node_id} cannot load layers {request.layer_range}: "
                f"its slice is {inv.state} for {inv.layer_range}; Prepare it first"
                + (f" ({inv.error})" if inv.error else "")
            )
        if request.manifest_sha256 and inv.manifest_sha256 != request.manifest_sha256:
            raise InvalidRequest(
                f"node {self.settings.node_id}: package manifest {inv.manifest_sha256[:12]} "
                f"differs from the coordinator's {request.manifest_sha256[:12]}"
            )
        return Path(inv.local_dir)

    def observe_coordinator_term(self, term: int) -> None:
        """The coordinator's current term (from a heartbeat reply). A loaded stage whose
        term is older has been left out of the coordinator's newer pipeline (it was
        declared dead while it hung, say): it drops its layers, sessions and queued
        work at once instead of serving stale frames.

        The common case (nothing to do) takes no lock: the heartbeat thread must never
        wait behind a Load, which holds the lock for as long as loading takes."""
        if term <= self.term or self.loaded is None:
            return
        with self._lock:
            if term <= self.term or self.loaded is None:
                return
            logger.warning(
                "the coordinator serves term %s; this stage still held term %s: releasing",
                term,
                self.term,
            )
            self._release_locked(f"term {self.term} is over (the coordinator is at term {term})")

    def on_newer_term(self, callback: Callable[[], None]) -> None:
        """Called (from the frame worker) when a frame of a newer term arrives."""
        self._on_newer_term = callback

    def release(self, term: int, reason: str) -> None:
        check_term(term, "Release")
        self._cancel_load(term, newer_only=False)
        with self._lock:
            if term < self.term:
                raise StaleTerm(
                    f"Release with term {term} refused: node holds term {self.term}",
                    held_term=self.term,
                )
            self._release_locked(reason)

    def _release_locked(self, reason: str) -> None:
        loaded, self.loaded = self.loaded, None
        self.state = "idle"
        if loaded is None:
            return
        logger.info("releasing layers %s: %s", loaded.request.layer_range, reason)
        self.heap.worked()
        if self.settings.gc_freeze:
            thaw()
        for link in (loaded.forward, loaded.returns):
            if link is not None:
                link.close()
        for session_id in loaded.engine.session_ids():
            loaded.engine.end_session(session_id)
        for listener in self._listeners:
            listener(None)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self._release_locked("stopping")
        self._enqueue(None)

    def active_sessions(self) -> int:
        """Sessions this stage holds (never waits for a step: ``RuntimeStats``)."""
        loaded = self.loaded
        return loaded.engine.runtime.stats().sessions if loaded is not None else 0

    def heartbeat(self) -> HeartbeatRequest:
        """What this node tells the coordinator every beat: its term and state, and
        its sessions and the KV cache they (and the kept prefixes) hold."""
        loaded = self.loaded
        stats = loaded.engine.runtime.stats() if loaded is not None else RuntimeStats()
        step_ms, step_frames = self.steps.mean()
        return HeartbeatRequest(
            node_id=self.settings.node_id,
            term=self.term,
            state=self.state,
            active_sessions=stats.sessions,
            kv_bytes=stats.kv_bytes,
            prefix_bytes=stats.prefix_bytes,
            step_ms=step_ms,
            step_frames=step_frames,
            link_error=loaded.link_error if loaded is not None else "",
            progress=self.progress(),
        )

    def progress(self) -> FrameProgress:
        """How far this term's frames have come here (``FrameProgress``)."""
        loaded = self.loaded
        received = received_bytes()
        if loaded is None:
            return FrameProgress(received=received)
        done = loaded.frames_done
        waiting = self.waiting
        if not loaded.request.is_first or waiting is None or waiting.term != loaded.request.term:
            return FrameProgress(done=done, received=received)
        compute_s = loaded.compute_s.get(waiting.frame_id, 0.0)
        return FrameProgress(
            received=received,
            done=done,
            waiting_frame=waiting.frame_id,
            waiting_s=max(0.0, time.perf_counter() - waiting.sent_at),
            waiting_compute_s=compute_s,
            longest_round_s=waiting.longest_round_s,
        )

    def manifest(self) -> PackageManifest | None:
        loaded = self.loaded
        return PackageManifest.load(loaded.package_dir) if loaded is not None else None

    # ---- data ------------------------------------------------------------------------

    def accept_frame(self, frame: Frame, ack: Callable[[FrameAck], None] | None) -> None:
        """A frame from the upstream stage (already validated by the servicer). When no
        frame is being processed or waiting, the receiving thread processes it at once
        (and sends its output on): handing it to the worker thread cost a thread switch
        and a hand-over of the GIL per hop. A stage busy with a frame queues the next
        one for the worker. Stage 0's own frames (``submit``) always go to the worker:
        its event loop must not compute."""
        work = _Work(frame, time.monotonic(), ack)
        with self._frames:
            if self._busy or self._pending or not self.settings.inline_frames:
                self._enqueue(work)
                return
            self._busy = True
        self._run(work)

    def _enqueue(self, work: _Work | None) -> None:
        with self._frames:
            self._pending.append(work)
            self._frames.notify()

    def _work_loop(self) -> None:
        while True:
            with self._frames:
                while self._busy or not self._pending:
                    self._frames.wait()
                work = self._pending.popleft()
                if work is None:
                    return
                self._busy = True
            self._run(work)

    def _run(self, work: _Work) -> None:
        """Process ``work`` (the caller set ``_busy``), then let the next frame go."""
        started = time.perf_counter()
        self._processing = (work.frame.frame_id, time.monotonic())
        try:
            self._process(work)
        except Exception:  # noqa: BLE001 - the stage must survive any frame
            logger.exception("frame worker failed on frame %s", work.frame.frame_id)
        finally:
            self._processing = None
            # A frame that failed is finished too (computed ones are marked as soon
            # as they are computed, in _process).
            loaded = self.loaded
            if loaded is not None and work.frame.term == loaded.request.term:
                if loaded.frames_done < work.frame.frame_id:
                    loaded.finished(work.frame.frame_id, time.perf_counter() - started)
            with self._frames:
                self._busy = False
                if self._pending:
                    self._frames.notify()

    def _process(self, work: _Work) -> None:
        frame = work.frame
        loaded = self.loaded
        try:
            if loaded is None:
                raise Unavailable(
                    f"node {self.settings.node_id} has no layers loaded; the mesh is reloading"
                )
            if frame.term != loaded.engine.term:
                if frame.term > loaded.engine.term and self._on_newer_term is not None:
                    # Upstream already serves a newer term: this stage's term is
                    # probably over. Ask the coordinator now rather than at the next beat.
                    self._on_newer_term()
                raise StaleTerm(
                    f"frame of term {frame.term} dropped: this stage serves term "
                    f"{loaded.engine.term}"
                )
            queued_s = time.monotonic() - work.received_at
            started = time.perf_counter()
            output = loaded.engine.process(frame, queued_s=queued_s)
            # Finished here, before it is sent on: a send that blocks waits on the
            # next stage (a stuck receiver fills the link), which the stall rule
            # must blame, not this one.
            loaded.finished(frame.frame_id, time.perf_counter() - started)
            self.metrics.frame_done(frame, queued_s, time.perf_counter() - started)
            if measures_step(frame):
                self.steps.observe((time.perf_counter() - started) * 1000.0)
            self.heap.worked()
        except MeshError as error:
            self._fail(loaded, work, error)
            return
        except Exception as error:  # noqa: BLE001 - reported to the requests, logged here
            if out_of_memory(error):
                rows = sum(s.token_count for s in frame.segments)
                error = CapacityExceeded(
                    f"stage {loaded.request.stage_index if loaded else 0} ran out of memory "
                    f"running a frame of {rows} rows ({error}); retry later, or lower the "
                    "load on this stage (--kv-max-sessions, --max-tokens-per-session, "
                    "--max-batch-tokens)"
                )
            else:
                logger.exception("frame %s of term %s failed", frame.frame_id, frame.term)
            self._fail(loaded, work, error)
            return
        if output.failures and not loaded.engine.is_last:
            for failure in output.failures:
                logger.warning(
                    "request %s: segment at %s refused: %s",
                    failure.request_id,
                    failure.pos_start,
                    failure.error.message if failure.error else "",
                )
            self._route_result(loaded, FrameResult(frame.term, frame.frame_id, output.failures))
        if output.forward is not None and loaded.forward is not None:
            try:
                loaded.forward.send(frame_to_proto(output.forward, loaded.request.wire_dtype))
            except MeshError as error:
                self._fail_segments(loaded, output.forward, error)
        if output.result is not None:
            self._route_result(loaded, output.result)

    def _fail(self, loaded: LoadedStage | None, work: _Work, error: BaseException) -> None:
        frame = work.frame
        logger.warning("frame %s of term %s failed: %s", frame.frame_id, frame.term, error)
        self.metrics.frame_failed(error)
        index = loaded.request.stage_index if loaded is not None else 0
        if work.ack is not None:
            work.ack(FrameAck(frame.frame_id, ErrorInfo.from_exception(error, index)))
        if loaded is not None:
            self._fail_segments(loaded, frame, error)

    def _fail_segments(self, loaded: LoadedStage, frame: Frame, error: BaseException) -> None:
        """Tell stage 0 that every segment of ``frame`` failed. The answer carries the
        frame's term, never the node's, so that stage 0 can tell it from an error of
        its current term."""
        index = loaded.request.stage_index
        failures = tuple(
            SegmentResult.failure(s, error, index)
            for s in frame.segments
            if s.kind is not SegmentKind.END
        )
        if failures:
            self._route_result(loaded, FrameResult(frame.term, frame.frame_id, failures))

    def _route_result(self, loaded: LoadedStage, result: FrameResult) -> None:
        if loaded.request.is_first:
            if self._result_sink is not None:
                self._result_sink(result)
            return
        if loaded.returns is not None:
            try:
                loaded.returns.send(result_to_proto(result))
            except MeshError as error:
                logger.warning("cannot return the results of frame %s: %s", result.frame_id, error)

    def _downstream_ack(self, ack: FrameAck) -> None:
        if ack.error is not None:
            logger.info("downstream refused frame %s: %s", ack.frame_id, ack.error.message)

    def _grammars_for(self, package_dir: Path) -> TokenGrammars:
        """The grammar compiler of ``package_dir``'s tokenizer: the one of an earlier
        load of the same package (a failover or a new plan keeps its tokenizer and
        compiled grammars), else a new one."""
        if self._grammars is None or self._grammars.tokenizer_dir != package_dir:
            self._grammars = TokenGrammars(package_dir)
        return self._grammars

    def _downstream_broken(self, loaded: LoadedStage, error: Exception) -> None:
        index = loaded.request.stage_index
        failure = Unavailable(f"stage {index + 1} is unreachable from stage {index}: {error}")
        # Kept with the load (one still finishing reports it once it serves).
        loaded.broken_links["forward"] = failure.message
        self.metrics.link_breaks.labels(link="forward").inc()
        if self.loaded is not loaded:
            return
        self._repair(loaded, "forward")
        segments = tuple(
            Segment(request_id, session_id, SegmentKind.DECODE, 0)
            for session_id, request_id in loaded.engine.active_requests()
        )
        if segments:
            self._fail_segments(loaded, Frame(loaded.request.term, 0, segments), failure)
        for listener in self._broken_listeners:
            listener(failure.message)

    def _return_broken(self, loaded: LoadedStage, error: Exception) -> None:
        index = loaded.request.stage_index
        logger.warning("return link to stage 0 broke: %s", error)
        loaded.broken_links["return"] = f"stage {index} cannot reach stage 0: {error}"
        self.metrics.link_breaks.labels(link="return").inc()
        if self.loaded is loaded:
            self._repair(loaded, "return")

    # ---- links opened again while no coordinator acts ----------------------------

    def on_link_reopened(self, listener: Callable[[LoadedStage, str], None]) -> None:
        """``listener(loaded, kind)`` runs when this stage opened its broken ``kind``
        link ("forward", "return") of ``loaded``'s term again (``_repair``)."""
        self._reopened_listeners.append(listener)

    def _repair(self, loaded: LoadedStage, kind: str) -> None:
        """Open the broken ``kind`` link of ``loaded`` again once its peer can take it,
        while the coordinator cannot be reached. With a coordinator it is its call: it
        plans a new pipeline around the break. Without one nothing would, and a link
        that broke for a while (packets dropped past SEND_TIMEOUT_S, a connection
        reset by the network) would leave the pipeline down until a coordinator
        returns, though every stage still serves the term."""
        with self._repair_lock:
            if kind in loaded.repairing:
                return
            loaded.repairing.add(kind)
        NamedThread(
            target=self._repair_loop, args=(loaded, kind), name=f"repair-{kind}", daemon=True
        ).start()

    def _repair_loop(self, loaded: LoadedStage, kind: str) -> None:
        try:
            while True:
                self._repair_until_open(loaded, kind)
                with self._repair_lock:
                    # A link that broke again once this thread had opened it found the
                    # thread still running (``_repair`` started none): go on.
                    again = kind in loaded.broken_links and self.loaded is loaded
                    if not again or self._stopping.is_set():
                        loaded.repairing.discard(kind)
                        return
        except BaseException:
            with self._repair_lock:
                loaded.repairing.discard(kind)
            raise

    def _repair_until_open(self, loaded: LoadedStage, kind: str) -> None:
        said = ""
        while not self._stopping.wait(REPAIR_INTERVAL_S):
            if self.loaded is not loaded or kind not in loaded.broken_links:
                return
            if self.coordinator_outage() <= 0:
                continue
            why = self._reopen(loaded, kind)
            if not why:
                return
            if why != said:
                said = why
                logger.info(
                    "the %s link of term %s stays broken while the coordinator is "
                    "unreachable: %s (trying again every %.0f s)",
                    kind,
                    loaded.request.term,
                    why,
                    REPAIR_INTERVAL_S,
                )

    def _open_link(
        self,
        loaded: LoadedStage,
        kind: str,
        cancelled: Callable[[], bool],
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> DataLink:
        """Open ``loaded``'s ``kind`` link ("forward": to the next stage; "return": to
        stage 0); ``cancelled()`` true gives up waiting for the peer, which is waited
        for up to ``connect_timeout_s``."""
        delay_s = self.settings.inject_delay_ms / 1000.0
        traffic = self.metrics.sent[kind]
        if kind == "forward":
            return open_forward_link(
                loaded.request.downstream.address,  # type: ignore[union-attr]
                on_broken=lambda error: self._downstream_broken(loaded, error),
                on_ack=self._downstream_ack,
                delay_s=delay_s,
                traffic=traffic,
                cancelled=cancelled,
                connect_timeout_s=connect_timeout_s,
            )
        return open_return_link(
            loaded.request.return_endpoint,
            on_broken=lambda error: self._return_broken(loaded, error),
            delay_s=delay_s,
            traffic=traffic,
            cancelled=cancelled,
            connect_timeout_s=connect_timeout_s,
        )

    def _reopen(self, loaded: LoadedStage, kind: str) -> str:
        """Open ``loaded``'s ``kind`` link again; why it cannot be yet ("": it is
        open). The peer must still serve the same term (a stage restarted in the
        meantime holds no layers) and, for a Forward link, have its own Forward link
        whole (a break further down travels up: each stage opens its link once the
        one below it is whole)."""
        request = loaded.request
        term = request.term
        forward = kind == "forward"
        address = request.downstream.address if forward else request.return_endpoint
        try:
            serving, peer_broken = peer_serving(address, REPAIR_PROBE_TIMEOUT_S)
        except MeshError as error:
            return error.message
        if serving != term:
            held = f"term {serving}" if serving else "no layers"
            return f"{address} serves {held}, not term {term}"
        if forward and peer_broken:
            return f"the link of {address} to the stage after it is broken too"
        try:
            # A short wait: a dial started while the network still drops packets
            # must not hold the link shut for long once it passes them again.
            link = self._open_link(
                loaded, kind, lambda: self.loaded is not loaded, REPAIR_PROBE_TIMEOUT_S
            )
        except MeshError as error:
            return error.message
        with self._lock:
            if self.loaded is not loaded:
                link.close()
                return ""
            old = loaded.forward if forward else loaded.returns
            if forward:
                loaded.forward = link
            else:
                loaded.returns = link
            cleared = loaded.broken_links.pop(kind, "")
            if link.broken:  # it broke again already (its report may have come first)
                loaded.broken_links[kind] = cleared
        if old is not None:
            old.close()
        self.metrics.links_reopened.labels(link=kind).inc()
        logger.warning(
            "opened the %s link of term %s to %s (%s) again (it broke while the "
            "coordinator was unreachable)",
            kind,
            term,
            link.address,
            address,
        )
        if not forward:
            # Stage 0 learns that the answers of the frames this stage had finished
            # may have gone with the old link (later ones travel on the new one).
            note = FrameResult(term, loaded.frames_done, (), reopened=True, reopened_link="return")
            self._tell_stage_0(link, note)
        elif not request.is_first and loaded.returns is not None:
            # Stage 0 learns that the pipeline below this stage is whole again: the
            # requests the break lost may read their tokens again once its own link
            # is whole. (Its own link breaks too when this one does, as this stage
            # closes the links into it; this note does not depend on that.)
            note = FrameResult(term, 0, (), reopened=True, reopened_link="forward")
            self._tell_stage_0(loaded.returns, note)
        for listener in self._reopened_listeners:
            listener(loaded, kind)
        return ""

    @staticmethod
    def _tell_stage_0(link: DataLink, note: FrameResult) -> None:
        """Send stage 0 ``note`` (a link opened again) on Return link ``link``."""
        try:
            link.send(result_to_proto(note))
        except MeshError as error:
            logger.warning(
                "cannot tell stage 0 the %s link is open again: %s", note.reopened_link, error
            )

    def _check_stuck(self) -> None:
        """End the process when one frame has been processing for longer than
        ``stuck_exit_after_s``: a device call or a deadlock that never returns is
        cleared only by a restart, which its service manager (or ``up``) does."""
        limit = self.settings.stuck_exit_after_s
        processing = self._processing
        if limit <= 0 or processing is None:
            return
        frame_id, since = processing
        stuck_s = time.monotonic() - since
        if stuck_s < limit:
            return
        logger.critical(
            "frame %s has been processing for %.0f s (--stuck-exit-after %.0f): its "
            "thread is stuck (a hung device call or a deadlock); exiting with status %d "
            "so that this stage is started again",
            frame_id,
            stuck_s,
            limit,
            STUCK_EXIT_STATUS,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(STUCK_EXIT_STATUS)

    def _stuck_loop(self) -> None:
        # A thread of its own: the idle sweep waits for the runtime, which a stuck
        # step holds.
        while not self._stopping.wait(IDLE_SWEEP_S):
            self._check_stuck()

    def _sweep_loop(self) -> None:
        while not self._stopping.wait(IDLE_SWEEP_S):
            self.heap.maybe_trim()
            loaded = self.loaded
            if loaded is None or loaded.request.session_idle_timeout_s <= 0:
                continue
            try:
                loaded.engine.expire_idle(loaded.request.session_idle_timeout_s)
            except Exception:  # noqa: BLE001 - the sweep must outlive any one pass
                logger.exception("idle session sweep failed; the next one goes on")


def inventory_reply(term: int, inv: SliceInventory) -> InventoryReply:
    """The Inventory answer for the resolver's current inventory."""
    return InventoryReply(
        term=term,
        package_ref=inv.package_ref or "",
        layer_range=inv.layer_range,
        state=inv.state,
        bytes_done=inv.bytes_done,
        bytes_total=inv.bytes_total,
        files=tuple(
            FileInventory(
                path=f.path,
                state=f.state,
                bytes_done=f.bytes_done,
                bytes_total=f.bytes_total,
                error=f.error or "",
            )
            for f in inv.files
        ),
        error=inv.error or "",
        manifest_sha256=inv.manifest_sha256 or "",
    )
