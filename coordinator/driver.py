"""The load driver: turns a Plan into a serving pipeline over the stages' control API.

Claim every stage with the new term; Prepare each with its range; poll Inventory
until every exact range is ready; Load from the last stage upstream so each stage
learns its downstream endpoint from the next one's Ready. If any step fails, every
stage of the attempt is Released and the error names the stage, its address and
the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.planner import Plan, StageAssignment
from mesh.codec import (
    ClaimRequest,
    InventoryReply,
    InventoryRequest,
    PeerRef,
    PrepareRequest,
    Ready,
    ReleaseRequest,
    StageLoadRequest,
    WireDType,
)
from mesh.errors import CapacityExceeded, LinkUnreachable, MeshError, StaleTerm
from mesh.grpc_util import CONTROL_DEADLINE_S, LOAD_DEADLINE_S, channel, error_from_rpc
from mesh.proto.v1 import stage_pb2_grpc
from mesh.settings.sections import FrontendConfig

logger = logging.getLogger(__name__)

# How often a Load in progress looks at ``abort`` (a stage lost meanwhile), and how
# long a Release may take (a stage that does not answer learns that its term is over
# from its next heartbeat's reply).
ABORT_POLL_S = 0.25
RELEASE_DEADLINE_S = 3.0


@dataclass(frozen=True)
class LoadSettings:
    package_ref: str
    manifest_sha256: str
    model_id: str
    wire_dtype: WireDType = WireDType.F32
    torch_dtype: str = "auto"
    max_sessions: int = FrontendConfig.max_concurrent_requests
    max_tokens_per_session: int = 2048
    max_batch_tokens: int = FrontendConfig.max_batch_tokens
    session_idle_timeout_s: float = 300.0
    # Stage 0's serving settings, (key, JSON value, origin): mesh.settings.commands.
    serving: tuple[tuple[str, str, str], ...] = ()
    inventory_timeout_s: float = 600.0
    inventory_poll_s: float = 0.2


class LoadError(MeshError):
    """A load attempt failed at one stage and step; every stage was released."""

    grpc_code = "UNAVAILABLE"
    http_status = 503

    def __init__(
        self,
        stage: StageAssignment | None,
        step: str,
        cause: str,
        held_term: int = 0,
        busy: bool = False,
        unreachable_link: str = "",
    ) -> None:
        where = (
            f"stage {stage.stage_index} ({stage.node_id} at {stage.address})"
            if stage is not None
            else "the mesh"
        )
        super().__init__(f"{where} failed at {step}: {cause}")
        self.stage = stage
        self.step = step
        # The term the stage holds when it refused a stale term (0 otherwise).
        self.held_term = held_term
        # A Claim ``only_if_idle`` refused: the stage serves requests (nothing was
        # fenced, nothing is released).
        self.busy = busy
        # The data link the stage could not open at Load (``forward``, ``return``;
        # "": another failure): the node it could not reach is the one to blame.
        self.unreachable_link = unreachable_link


@dataclass(frozen=True)
class LoadOutcome:
    term: int
    ready: tuple[Ready, ...]  # in stage order


class LoadDriver:
    def __init__(
        self,
        coordinator_id: str,
        devices: Callable[[str], str],
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """``on_progress(node_id, bytes_done, bytes_total)`` hears every Inventory."""
        self.coordinator_id = coordinator_id
        self._devices = devices
        self._on_progress = on_progress

    def load(
        self,
        plan: Plan,
        term: int,
        settings: LoadSettings,
        abort: Callable[[], str | None] | None = None,
    ) -> LoadOutcome:
        """Load ``plan`` at ``term``. ``abort()`` is asked while slices are awaited and
        while a stage loads, and ends the attempt (a LoadError of step "Abort") when
        it names a reason: a stage that hangs in Load (a stopped process, a swapping
        host) would otherwise hold the fenced mesh for the Load deadline."""
        stages = list(plan.stages)
        with _stubs(stages) as stubs:
            try:
                return self._load(stages, stubs, term, settings, abort)
            except LoadError as error:
                logger.error("load of term %s failed: %s", term, error.message)
                self._release_all(stages, stubs, term, f"load failed: {error.message}")
                raise

    def claim_if_idle(self, stage0: StageAssignment, term: int, settings: LoadSettings) -> None:
        """Claim stage 0 with ``term`` unless it serves requests now: a LoadError with
        ``busy`` then, and nothing is fenced. Once it is claimed, ``load`` claims it
        again (the same term: nothing more happens there)."""
        with _stubs([stage0]) as stubs:
            self._claim([stage0], stubs, term, settings, only_if_idle=True)

    def stage_ahead(
        self,
        newcomers: list[StageAssignment],
        term: int,
        moved: list[StageAssignment],
        serving_term: int,
        settings: LoadSettings,
        abort: Callable[[], str | None],
    ) -> None:
        """Get the slices of a plan ready while the pipeline of ``serving_term`` goes on
        serving: Claim and Prepare ``newcomers`` (nodes serving nothing now) at
        ``term``, Prepare ``moved`` (serving stages whose layer range changes) at the
        term they serve, which fences nothing, and wait until every slice is ready.
        ``abort()`` is asked between polls and ends the wait (a LoadError of step
        "Abort") when it names a reason. On a failure the newcomers are released and
        the serving stages left as they are; on success the newcomers stay claimed for
        ``load``, whose Prepare then finds every slice ready."""
        stages = newcomers + moved
        terms = {s.node_id: term for s in newcomers} | {s.node_id: serving_term for s in moved}
        with _stubs(stages) as stubs:
            try:
                self._claim(newcomers, stubs, term, settings)
                self._prepare(stages, stubs, terms, settings)
                self._await_inventory(stages, stubs, terms, settings, abort)
            except LoadError as error:
                logger.warning("slices ahead of term %s: %s", term, error.message)
                self._release_all(newcomers, stubs, term, f"slices ahead failed: {error.message}")
                raise

    def _load(self, stages, stubs, term: int, settings: LoadSettings, abort=None):
        terms = {s.node_id: term for s in stages}
        self._claim(stages, stubs, term, settings)
        self._prepare(stages, stubs, terms, settings)
        self._await_inventory(stages, stubs, terms, settings, abort)
        ready: dict[int, Ready] = {}
        downstream: PeerRef | None = None
        stage0 = stages[0]
        for stage in reversed(stages):
            index = stage.stage_index
            request = StageLoadRequest(
                term=term,
                stage_index=index,
                stage_count=len(stages),
                layer_range=stage.layer_range,
                package_ref=settings.package_ref,
                manifest_sha256=settings.manifest_sha256,
                downstream=downstream,
                return_endpoint=stage0.address,
                wire_dtype=settings.wire_dtype,
                device=self._devices(stage.node_id),
                torch_dtype=settings.torch_dtype,
                max_sessions=settings.max_sessions,
                max_tokens_per_session=settings.max_tokens_per_session,
                max_batch_tokens=settings.max_batch_tokens,
                session_idle_timeout_s=settings.session_idle_timeout_s,
                serving=settings.serving if index == 0 else (),
            )
            reply = self._call(
                stage,
                "Load",
                lambda s=stage, r=request: _awaited(
                    stubs[s.node_id].Load.future(r.to_proto(), timeout=LOAD_DEADLINE_S),
                    abort,
                ),
            )
            ready[index] = Ready.from_proto(reply)
            downstream = PeerRef(stage.node_id, ready[index].data_endpoint)
            logger.info(
                "stage %s (%s) ready at %s: layers %s, %s parameter bytes, %.0f ms",
                index,
                stage.node_id,
                ready[index].data_endpoint,
                stage.layer_range,
                ready[index].param_bytes,
                ready[index].load_ms,
            )
        return LoadOutcome(term, tuple(ready[i] for i in range(len(stages))))

    def _claim(
        self, stages, stubs, term: int, settings: LoadSettings, only_if_idle: bool = False
    ) -> None:
        self._each(
            stages,
            "Claim",
            lambda s: stubs[s.node_id].Claim(
                ClaimRequest(
                    term=term,
                    coordinator_id=self.coordinator_id,
                    model_id=settings.model_id,
                    only_if_idle=only_if_idle,
                ).to_proto(),
                timeout=CONTROL_DEADLINE_S,
            ),
        )

    def _prepare(self, stages, stubs, terms: dict[str, int], settings: LoadSettings) -> None:
        self._each(
            stages,
            "Prepare",
            lambda s: stubs[s.node_id].Prepare(
                PrepareRequest(
                    term=terms[s.node_id],
                    package_ref=settings.package_ref,
                    layer_range=s.layer_range,
                    manifest_sha256=settings.manifest_sha256,
                ).to_proto(),
                timeout=CONTROL_DEADLINE_S,
            ),
        )

    def _each(self, stages, step: str, call: Callable[[StageAssignment], object]) -> None:
        """``call`` each stage in order, as load step ``step``."""
        for stage in stages:
            self._call(stage, step, lambda s=stage: call(s))

    def _await_inventory(
        self,
        stages,
        stubs,
        terms: dict[str, int],
        settings: LoadSettings,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        deadline = time.monotonic() + settings.inventory_timeout_s
        pending = {s.node_id: s for s in stages}
        last: dict[str, InventoryReply] = {}
        while pending:
            for node_id, stage in list(pending.items()):
                reply = InventoryReply.from_proto(
                    self._call(
                        stage,
                        "Inventory",
                        lambda s=stage: stubs[s.node_id].Inventory(
                            InventoryRequest(term=terms[s.node_id]).to_proto(),
                            timeout=CONTROL_DEADLINE_S,
                        ),
                    )
                )
                last[node_id] = reply
                if self._on_progress is not None:
                    self._on_progress(node_id, reply.bytes_done, reply.bytes_total)
                if reply.state == "failed":
                    raise LoadError(stage, "Prepare", reply.error or "slice preparation failed")
                if reply.state == "ready" and reply.layer_range == stage.layer_range:
                    if settings.manifest_sha256 and reply.manifest_sha256 not in (
                        "",
                        settings.manifest_sha256,
                    ):
                        raise LoadError(
                            stage,
                            "Prepare",
                            f"its package manifest {reply.manifest_sha256[:12]} differs from "
                            f"the coordinator's {settings.manifest_sha256[:12]}",
                        )
                    del pending[node_id]
            if not pending:
                return
            reason = abort() if abort is not None else None
            if reason:
                raise LoadError(None, "Abort", reason)
            if time.monotonic() > deadline:
                slow = next(iter(pending.values()))
                inv = last.get(slow.node_id)
                progress = f"{inv.bytes_done}/{inv.bytes_total} bytes" if inv else "no answer"
                raise LoadError(
                    slow,
                    "Inventory",
                    f"slice {slow.layer_range} not ready after "
                    f"{settings.inventory_timeout_s:.0f}s ({progress})",
                )
            time.sleep(settings.inventory_poll_s)

    def _call(self, stage: StageAssignment, step: str, fn: Callable[[], object]):
        try:
            return fn()
        except grpc.RpcError as error:
            cause = error_from_rpc(error, step)
            held = cause.held_term if isinstance(cause, StaleTerm) else 0
            busy = step == "Claim" and isinstance(cause, CapacityExceeded)
            link = cause.link if isinstance(cause, LinkUnreachable) else ""
            raise LoadError(stage, step, _strip(cause.message, step), held, busy, link) from None

    def _release_all(self, stages, stubs, term: int, reason: str) -> None:
        """Release every stage at once (one that hangs delays none of the others)."""
        request = ReleaseRequest(term=term, reason=reason).to_proto()
        calls = [
            (stage, stubs[stage.node_id].Release.future(request, timeout=RELEASE_DEADLINE_S))
            for stage in stages
        ]
        for stage, call in calls:
            try:
                call.result()
            except grpc.RpcError as error:
                logger.warning(
                    "release of stage %s (%s) failed: %s",
                    stage.stage_index,
                    stage.address,
                    error.code().name,
                )


@contextmanager
def _stubs(stages: list[StageAssignment]) -> Iterator[dict[str, Any]]:
    """StageControl stubs by node id, their channels closed on exit."""
    channels = {s.node_id: channel(s.address) for s in stages}
    try:
        yield {n: stage_pb2_grpc.StageControlStub(c) for n, c in channels.items()}
    finally:
        for ch in channels.values():
            ch.close()


def release_nodes(addresses: list[tuple[str, str]], term: int, reason: str) -> None:
    """Best-effort Release of (node_id, address) pairs outside a load attempt."""
    for node_id, address in addresses:
        ch = channel(address)
        try:
            stage_pb2_grpc.StageControlStub(ch).Release(
                ReleaseRequest(term=term, reason=reason).to_proto(), timeout=2.0
            )
        except grpc.RpcError as error:
            logger.info("release of %s at %s: %s", node_id, address, error.code().name)
        finally:
            ch.close()


def _awaited(call: Any, abort: Callable[[], str | None] | None) -> object:
    """The reply of the gRPC ``call`` (a future), asking ``abort`` while it runs: a
    reason cancels the call and ends the attempt."""
    while True:
        try:
            return call.result(timeout=ABORT_POLL_S)
        except grpc.FutureTimeoutError:
            reason = abort() if abort is not None else None
            if reason:
                call.cancel()
                raise LoadError(None, "Abort", reason) from None


def _strip(message: str, step: str) -> str:
    prefix = f"{step}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
