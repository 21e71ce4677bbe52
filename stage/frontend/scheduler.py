"""Stage 0's generation backend: runs every request as a session in flight through
the pipeline.

Each request is an asyncio task that sends frames for its session (prefill chunks,
then one decode or verify frame per round) and awaits the token ids the last stage
returns. Stage 0's own layers run on the node's worker thread, later stages in their
own processes, so while stage 1 works on request A, stage 0 works on request B.
A session limit and a bounded admission queue give back-pressure (429).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from mesh.codec import Frame, FrameKind, TokenResult
from mesh.errors import CapacityExceeded, InvalidRequest, Unavailable
from mesh.metrics import Registry
from mesh.package.manifest import PackageManifest
from stage.frontend.backend import GenerationRequest, GenerationStats, TokenEvent
from stage.node import LoadedStage, StageNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    max_sessions: int = 16
    max_queued: int = 32
    prefill_chunk_tokens: int = 512
    round_timeout_s: float = 120.0


class PipelineScheduler:
    """Implements the HTTP layer's GenerationBackend over a stage-0 StageNode."""

    def __init__(self, node: StageNode, model_id: str, limits: SchedulerLimits) -> None:
        self.node = node
        self.model_id = model_id
        self.context_length = 0
        self.limits = limits
        self._loaded: LoadedStage | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, asyncio.Future] = {}
        self._active = 0
        self._queued = 0
        self._slots: asyncio.Semaphore | None = None
        self.registry = Registry()
        self._m_sessions = self.registry.gauge("mesh_sessions_active", "Requests in flight.")
        self._m_queued = self.registry.gauge("mesh_requests_queued", "Requests waiting.")
        self._m_rounds = self.registry.counter(
            "mesh_pipeline_rounds_total", "Frames sent through the pipeline.", ("kind",)
        )
        self._m_stage_ms = self.registry.histogram(
            "mesh_stage_compute_ms",
            "Compute time per frame on each stage, in ms.",
            ("stage",),
            buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000),
        )
        self._m_round_ms = self.registry.histogram(
            "mesh_pipeline_round_ms",
            "Time from sending a frame to receiving its tokens, in ms.",
            ("kind",),
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000),
        )
        node.set_result_sink(self._on_result)
        node.on_load_change(self._on_load_change)

    # ---- GenerationBackend ---------------------------------------------------------

    def ready(self) -> bool:
        return self._loaded is not None

    def unavailable_reason(self) -> str | None:
        if self._loaded is None:
            return "the pipeline is not loaded yet (or is reloading after a stage was lost)"
        return None

    def metrics_text(self) -> str:
        self._m_sessions.set(self._active)
        self._m_queued.set(self._queued)
        return self.registry.render()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        loaded = self._admit_check()
        self._loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.max_sessions)
        if self._active + self._queued >= self.limits.max_sessions + self.limits.max_queued:
            raise CapacityExceeded(
                f"{self._active} requests in flight and {self._queued} queued, the limit; "
                "retry shortly"
            )
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        self._active += 1
        session = request.request_id
        started = time.perf_counter()
        try:
            async for event in self._run(loaded, request, started):
                yield event
        finally:
            self._active -= 1
            self._slots.release()
            self._waiters.pop(session, None)
            if self._loaded is loaded:
                self.node.submit(Frame(session, session, FrameKind.END, 0, term=self._term()))

    # ---- the per-request loop ---------------------------------------------------------

    def _admit_check(self) -> LoadedStage:
        loaded = self._loaded
        if loaded is None:
            raise Unavailable(self.unavailable_reason() or "not ready")
        return loaded

    def _term(self) -> int:
        loaded = self._loaded
        return loaded.request.term if loaded is not None else 0

    async def _run(
        self, loaded: LoadedStage, request: GenerationRequest, started: float
    ) -> AsyncGenerator[TokenEvent, None]:
        session = request.request_id
        term = loaded.request.term
        prompt = request.prompt_tokens
        if not prompt:
            raise InvalidRequest("the prompt is empty; send at least one token")
        chunk = max(1, self.limits.prefill_chunk_tokens)
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            final = start + chunk >= len(prompt)
            frame = Frame(
                request_id=session,
                session_id=session,
                kind=FrameKind.PREFILL,
                pos_start=start,
                token_ids=piece,
                sampling=request.sampling if start == 0 else None,
                term=term,
                sample=final,
            )
            if final:
                result = await self._round(frame)
            else:
                self._send(frame)
        prompt_ms = (time.perf_counter() - started) * 1000.0
        decode_started = time.perf_counter()
        produced = 0
        while True:
            tokens = list(result.token_ids)
            finish = None
            out: list[int] = []
            for token in tokens:
                if token in request.stop_token_ids:
                    finish = "stop"
                    break
                out.append(token)
                if produced + len(out) >= request.max_new_tokens:
                    finish = "length"
                    break
            produced += len(out)
            stats = GenerationStats(
                prompt_tokens=len(prompt),
                completion_tokens=produced,
                prompt_ms=prompt_ms,
                decode_ms=(time.perf_counter() - decode_started) * 1000.0,
            )
            yield TokenEvent(token_ids=tuple(out), finish_reason=finish, stats=stats)
            if finish is not None:
                return
            position = len(prompt) + produced - 1
            frame = Frame(
                request_id=session,
                session_id=session,
                kind=FrameKind.DECODE,
                pos_start=position,
                token_ids=(out[-1],),
                term=term,
            )
            result = await self._round(frame)

    def _send(self, frame: Frame) -> None:
        self._m_rounds.labels(frame.kind.value).inc()
        self.node.submit(frame)

    async def _round(self, frame: Frame) -> TokenResult:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters[frame.request_id] = waiter
        sent = time.perf_counter()
        self._send(frame)
        try:
            result = await asyncio.wait_for(waiter, self.limits.round_timeout_s)
        except TimeoutError:
            raise Unavailable(
                f"no answer from the pipeline within {self.limits.round_timeout_s:.0f}s "
                f"for request {frame.request_id}"
            ) from None
        finally:
            self._waiters.pop(frame.request_id, None)
        if result.error is not None:
            raise result.error.to_error()
        self._m_round_ms.labels(frame.kind.value).observe((time.perf_counter() - sent) * 1000.0)
        for timing in result.timings:
            self._m_stage_ms.labels(str(timing.stage_index)).observe(timing.compute_ms)
        return result

    # ---- results from the node (worker thread or Return stream thread) ---------------

    def _on_result(self, result: TokenResult) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(self._deliver, result)

    def _deliver(self, result: TokenResult) -> None:
        waiter = self._waiters.get(result.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        previous, self._loaded = self._loaded, loaded
        if loaded is not None:
            runtime = loaded.engine.runtime
            self.context_length = runtime.max_tokens_per_session
            self.model_id = PackageManifest.load(loaded.package_dir).model_id
        if previous is not None and loaded is not previous and self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, "the pipeline was released")

    def _fail_all(self, reason: str) -> None:
        for waiter in list(self._waiters.values()):
            if not waiter.done():
                waiter.set_exception(Unavailable(reason))
