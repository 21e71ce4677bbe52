"""Stage 0's live status page: ``GET /status`` (the page), ``GET /status.js`` (its
script), ``GET /status.json`` (what it shows) and ``GET /`` (a redirect to the
page). The page polls the JSON every second.

The JSON names every node's address, so it needs the API key when one is set
(``Authorization: Bearer <key>``, as the ``/v1`` routes); the page and its script
hold no data and stay open, and the page asks for the key. The topology comes
from the coordinator's Status RPC, which a thread of its own asks every second
(whether anyone looks or not, so that a failover is noted when it happens; the
event loop never waits for the network), the rest from stage 0's own objects.
These routes answer before the pipeline is loaded too: that is when an operator
needs them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from mesh.api_keys import KeySource, request_tenant
from mesh.codec import HeartbeatRequest, StatusReply, StatusRequest
from mesh.grpc_util import channel
from mesh.package.manifest import PackageManifest
from mesh.proto.v1 import coordinator_pb2_grpc
from mesh.speculative import Telemetry
from stage.frontend.scheduler import PipelineScheduler
from stage.frontend.status import EventLog, WarningEvents, coordinator_changes
from stage.frontend.status_view import LocalStatus, SpeculationStatus, status_document
from stage.node import LoadedStage, StageNode

logger = logging.getLogger(__name__)

STATUS_PATHS = frozenset({"/", "/status", "/status.js", "/status.json"})
STATIC_DIR = Path(__file__).parent / "static"
# The coordinator is asked this often, and waited for this long.
COORDINATOR_EVERY_S = 1.0
COORDINATOR_DEADLINE_S = 2.0
NOT_ASKED = "not asked yet"
# Nothing outside this origin: no CDN, no inline script, no frames.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


class StatusPage:
    """The ASGI app of the status routes, and what it remembers between polls."""

    def __init__(
        self,
        node: StageNode,
        scheduler: PipelineScheduler,
        coordinator: str,
        api_keys: KeySource | None,
    ) -> None:
        self.node = node
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.api_keys = api_keys
        self.started = time.monotonic()
        self.events = EventLog()
        self._warnings = WarningEvents(self.events)
        logging.getLogger().addHandler(self._warnings)
        # The coordinator's last answer, or None and why not: replaced whole by the
        # poller thread, read by the routes.
        self._latest: tuple[StatusReply | None, str] = (None, NOT_ASKED)
        self._seen: StatusReply | None = None
        self._channel: grpc.Channel | None = None
        self._term = 0
        self._manifest: tuple[str, PackageManifest] | None = None
        node.on_load_change(self._on_load_change)
        self.app = Starlette(
            routes=[
                Route("/", self._home),
                Route("/status", self._page),
                Route("/status.js", self._script),
                Route("/status.json", self._json),
            ]
        )
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="status-poll", daemon=True)
        self._poller.start()

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)

    def close(self) -> None:
        self._closed.set()
        self._poller.join(COORDINATOR_DEADLINE_S + 1.0)
        logging.getLogger().removeHandler(self._warnings)
        if self._channel is not None:
            self._channel.close()

    # ---- routes ----------------------------------------------------------------------

    async def _home(self, _: Request) -> Response:
        return RedirectResponse("/status", status_code=307)

    async def _page(self, _: Request) -> Response:
        body = (STATIC_DIR / "status.html").read_bytes()
        return Response(body, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def _script(self, _: Request) -> Response:
        body = (STATIC_DIR / "status.js").read_bytes()
        return Response(body, media_type="text/javascript; charset=utf-8", headers=PAGE_HEADERS)

    async def _json(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse(
                {
                    "error": {
                        "message": "missing or invalid API key; send it as "
                        "'Authorization: Bearer <key>'",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer", "cache-control": "no-store"},
            )
        local = self._local_status()
        activity = self.scheduler.activity.snapshot()
        # The runtime's lock, which the stage's worker holds while it computes.
        heartbeat = await asyncio.to_thread(self.node.heartbeat)
        local = _with_own_kv(local, heartbeat)
        reply, error = self._latest
        document = status_document(
            local, reply, error, activity, self.events.events(), now=time.time()
        )
        return JSONResponse(document, headers={"cache-control": "no-store"})

    def _authorized(self, request: Request) -> bool:
        if self.api_keys is None:
            return True
        return request_tenant(self.api_keys, request.headers) is not None

    # ---- what stage 0 knows --------------------------------------------------------------

    def _local_status(self) -> LocalStatus:
        """Stage 0's own figures, read on the event loop (the scheduler's state lives
        there); nothing here waits for a lock the stage's worker holds."""
        node, scheduler = self.node, self.scheduler
        core = scheduler.core
        common = dict(
            node_id=node.settings.node_id,
            address=node.address,
            coordinator=self.coordinator,
            ready=scheduler.ready(),
            reason=scheduler.unavailable_reason() or "",
            uptime_s=time.monotonic() - self.started,
            running=len(core.running),
            queued=core.queued,
            max_running=scheduler.limits.max_sessions,
            max_queued=scheduler.limits.max_queued,
            recoveries=core.recoveries,
            speculation=self._speculation(),
        )
        loaded = node.loaded
        if loaded is None:
            return LocalStatus(**common)
        request, runtime = loaded.request, loaded.engine.runtime
        manifest = self._manifest_of(loaded)
        scheme = manifest.scheme()
        return LocalStatus(
            **common,
            model_id=manifest.model_id,
            package_ref=request.package_ref,
            dtype=runtime.dtype,
            weights=scheme.kind if scheme is not None else manifest.dtype,
            wire_dtype=request.wire_dtype.value,
            device=runtime.device,
            context_length=runtime.max_tokens_per_session,
            layer_count=manifest.layer_count,
            term=request.term,
            stage_count=request.stage_count,
            layer_range=request.layer_range,
            param_bytes=runtime.param_bytes,
            pipeline_uptime_s=time.monotonic() - loaded.loaded_at,
        )

    def _manifest_of(self, loaded: LoadedStage) -> PackageManifest:
        key = str(loaded.package_dir)
        if self._manifest is None or self._manifest[0] != key:
            self._manifest = (key, PackageManifest.load(loaded.package_dir))
        return self._manifest[1]

    def _speculation(self) -> SpeculationStatus:
        scheduler = self.scheduler
        factory = scheduler.speculation
        totals = Telemetry()
        for telemetry in scheduler.telemetry_totals.values():
            totals = totals + telemetry
        return SpeculationStatus(
            strategy=factory.name if factory is not None else "",
            policy=factory.config.window_policy.default if factory is not None else "",
            notes=tuple(scheduler.speculation_summary()["notes"]),
            drafted=totals.drafted,
            accepted=totals.accepted,
            windows=totals.windows,
        )

    def _poll(self) -> None:
        """The poller thread: the coordinator's Status every COORDINATOR_EVERY_S;
        what changed since its last answer becomes events."""
        self._channel = channel(self.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        while not self._closed.is_set():
            try:
                self._ask(stub)
            except Exception:  # noqa: BLE001 - the page must outlive any one answer
                logger.exception("reading the coordinator's status failed")
            self._closed.wait(COORDINATOR_EVERY_S)

    def _ask(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        try:
            pb = stub.Status(StatusRequest().to_proto(), timeout=COORDINATOR_DEADLINE_S)
        except grpc.RpcError as error:
            if self._latest[0] is not None or self._latest[1] == NOT_ASKED:
                self.events.add(
                    "warning",
                    f"the coordinator {self.coordinator} does not answer: {error.code().name}",
                    key="coordinator-unreachable",
                )
            self._latest = (None, f"{error.code().name}: {error.details()}")
            return
        reply = StatusReply.from_proto(pb)
        for kind, message in coordinator_changes(self._seen, reply):
            self.events.add(kind, message)
        self._seen = reply
        self._latest = (reply, "")

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        if loaded is None:
            if self._term:
                self.events.add(
                    "lost",
                    f"the pipeline of term {self._term} was released; the coordinator "
                    "loads another",
                )
            return
        self._manifest_of(loaded)  # read here, not on the event loop
        request = loaded.request
        what = (
            f"term {request.term}, {request.stage_count} stage(s), "
            f"layers {request.layer_range} here"
        )
        if self._term and request.term != self._term:
            self.events.add("reload", f"pipeline reloaded: {what} (was term {self._term})")
        else:
            self.events.add("load", f"pipeline loaded: {what}")
        self._term = request.term


def _with_own_kv(local: LocalStatus, heartbeat: HeartbeatRequest) -> LocalStatus:
    return replace(
        local,
        kv_bytes=heartbeat.kv_bytes,
        prefix_bytes=heartbeat.prefix_bytes,
        sessions=heartbeat.active_sessions,
    )
