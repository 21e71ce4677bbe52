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
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from mesh.codec import Frame, FrameKind, TokenResult
from mesh.errors import CapacityExceeded, InvalidRequest, StaleTerm, Unavailable
from mesh.metrics import Registry
from mesh.package.manifest import PackageManifest
from mesh.speculative import (
    ConcurrencyRule,
    DrafterFactory,
    RoundContext,
    Telemetry,
    plan_window,
)
from stage.frontend.backend import GenerationRequest, TokenEvent
from stage.frontend.expectation import Expected, stale_reason
from stage.frontend.request_run import RequestRun
from stage.node import LoadedStage, StageNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    max_sessions: int = 16
    max_queued: int = 32
    prefill_chunk_tokens: int = 512
    round_timeout_s: float = 120.0
    recovery_timeout_s: float = 60.0


class PipelineScheduler:
    """Implements the HTTP layer's GenerationBackend over a stage-0 StageNode."""

    def __init__(
        self,
        node: StageNode,
        model_id: str,
        limits: SchedulerLimits,
        concurrency: ConcurrencyRule | None = None,
    ) -> None:
        self.node = node
        self.speculation: DrafterFactory | None = None
        self.detokenize: Callable[[Sequence[int]], str] | None = None
        self.concurrency = concurrency or ConcurrencyRule()
        self.telemetry_totals: dict[str, Telemetry] = {}
        self.recoveries = 0
        self.model_id = model_id
        self.context_length = 0
        self.limits = limits
        self._loaded: LoadedStage | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, tuple[asyncio.Future, Expected]] = {}
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
        self._m_recoveries = self.registry.gauge(
            "mesh_request_recoveries_total", "Requests resumed on a reloaded pipeline."
        )
        self._m_stale = self.registry.counter(
            "mesh_stale_results_total",
            "Results and errors dropped because they answer no frame in flight: of an "
            "older term (term), another position (position), too many tokens (count), or "
            "for a request no longer waiting (unclaimed).",
            ("reason",),
        )
        self._m_spec = self.registry.gauge(
            "mesh_speculation_tokens_total",
            "Speculation counters of finished requests, by strategy and counter.",
            ("strategy", "counter"),
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
        self._m_recoveries.set(self.recoveries)
        for strategy, totals in self.telemetry_totals.items():
            for key, value in (
                ("drafted", totals.drafted),
                ("accepted", totals.accepted),
                ("windows", totals.windows),
                ("rounds", totals.rounds),
                ("emitted", totals.emitted),
            ):
                self._m_spec.labels(strategy, key).set(value)
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
            if self._loaded is not None:
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
        """Prefill, then decode (or verify speculative windows) until a stop. When the
        pipeline is lost mid-request, wait for the reloaded one and rebuild the
        session's KV from the prompt and committed tokens, then carry on."""
        prompt = request.prompt_tokens
        if not prompt:
            raise InvalidRequest("the prompt is empty; send at least one token")
        run = RequestRun(request, self._new_speculation(request))
        run.term = loaded.request.term
        result = await self._resilient(run, lambda: self._prefill(run, prompt))
        run.prompt_ms = (time.perf_counter() - started) * 1000.0
        run.decode_started = time.perf_counter()
        emitted = list(result.token_ids)
        if run.drafter is not None:
            run.drafter.extend(emitted)
        while True:
            event = run.commit(emitted)
            if event.finish_reason is not None:
                self._finish(run)
                yield event
                return
            yield event
            drafts, draft_s = self._propose(run)
            sent = time.perf_counter()
            run.recovered = False
            result = await self._resilient(run, lambda d=drafts: self._step(run, d))
            emitted = list(result.token_ids)
            accepted = 0 if run.recovered else result.accepted_count
            run.observe(drafts, accepted, emitted, time.perf_counter() - sent, draft_s)

    def _new_speculation(self, request: GenerationRequest):
        factory = self.speculation
        if factory is None:
            return None
        drafter = factory.new_drafter()
        text = self.detokenize(request.prompt_tokens) if self.detokenize else None
        drafter.begin(request.prompt_tokens, prompt_text=text)
        return drafter, factory.new_policy(), factory.name

    def _propose(self, run: RequestRun) -> tuple[list[int], float]:
        if run.drafter is None:
            return [], 0.0
        context = RoundContext(
            tokens_left=run.tokens_left(),
            active_sessions=self._active,
            draft_cost_per_token_s=run.drafter.cost_per_token_s,
        )
        window = plan_window(run.policy, context, self.concurrency)
        if window <= 0:
            return [], 0.0
        started = time.perf_counter()
        drafts = run.drafter.propose(window)
        return drafts, time.perf_counter() - started

    async def _prefill(self, run: RequestRun, tokens: tuple[int, ...]) -> TokenResult:
        """Send ``tokens`` from position 0 as PREFILL chunks; the last one samples."""
        loaded = self._admit_check()
        chunk = max(1, self.limits.prefill_chunk_tokens)
        session = run.request.request_id
        run.term = loaded.request.term
        for start in range(0, len(tokens), chunk):
            final = start + chunk >= len(tokens)
            frame = Frame(
                request_id=session,
                session_id=session,
                kind=FrameKind.PREFILL,
                pos_start=start,
                token_ids=tokens[start : start + chunk],
                sampling=run.request.sampling if start == 0 else None,
                term=loaded.request.term,
                sample=final,
            )
            if final:
                return await self._round(frame)
            self._send(frame)
        raise InvalidRequest("the prompt is empty; send at least one token")

    async def _step(self, run: RequestRun, drafts: list[int]) -> TokenResult:
        """One decode round: [current] or a verify window [current, d1..dk]."""
        loaded = self._admit_check()
        session = run.request.request_id
        run.term = loaded.request.term
        return await self._round(
            Frame(
                request_id=session,
                session_id=session,
                kind=FrameKind.VERIFY if drafts else FrameKind.DECODE,
                pos_start=run.position,
                token_ids=(run.tokens[-1], *drafts),
                term=loaded.request.term,
            )
        )

    async def _resilient(self, run: RequestRun, attempt) -> TokenResult:
        """Run ``attempt``; if the pipeline is lost, wait for a new one (up to the
        recovery deadline) and rebuild the KV by re-prefilling every token so far."""
        try:
            return await attempt()
        except Unavailable as error:
            if self.limits.recovery_timeout_s <= 0:
                raise
            lost_at = time.monotonic()
            logger.warning(
                "request %s: pipeline lost (%s); waiting up to %.0fs for recovery",
                run.request.request_id,
                error.message,
                self.limits.recovery_timeout_s,
            )
        deadline = lost_at + self.limits.recovery_timeout_s
        while True:
            await self._await_new_pipeline(run, deadline)
            try:
                result = await self._prefill(run, tuple(run.tokens))
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                continue
            self.recoveries += 1
            run.recovered = True
            logger.info(
                "request %s resumed after %.1fs: re-prefilled %s tokens",
                run.request.request_id,
                time.monotonic() - lost_at,
                len(run.tokens),
            )
            return result

    async def _await_new_pipeline(self, run: RequestRun, deadline: float) -> None:
        failed_term = run.term
        while True:
            loaded = self._loaded
            if loaded is not None and loaded.request.term > failed_term:
                run.term = loaded.request.term
                return
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"the pipeline did not recover within {self.limits.recovery_timeout_s:.0f}s "
                    f"for request {run.request.request_id}; retry the request"
                )
            await asyncio.sleep(0.1)

    def _finish(self, run: RequestRun) -> None:
        telemetry = run.telemetry
        if telemetry is not None and run.strategy:
            self.telemetry_totals[run.strategy] = (
                self.telemetry_totals.get(run.strategy, Telemetry()) + telemetry
            )
        logger.info(
            "request %s done: prompt %s tokens, %s generated, %.1f tok/s%s",
            run.request.request_id,
            len(run.request.prompt_tokens),
            run.produced,
            run.produced / max(1e-9, time.perf_counter() - run.decode_started),
            (
                f", {run.strategy}: drafted {telemetry.drafted} accepted {telemetry.accepted} "
                f"rate {telemetry.accept_rate:.2f} windows {telemetry.windows} "
                f"tokens/round {telemetry.mean_tokens_per_round:.2f}"
                if telemetry is not None
                else ""
            ),
        )

    def _send(self, frame: Frame) -> None:
        self._m_rounds.labels(frame.kind.value).inc()
        self.node.submit(frame)

    async def _round(self, frame: Frame) -> TokenResult:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters[frame.request_id] = (waiter, Expected.for_frame(frame))
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
            error = result.error.to_error()
            if isinstance(error, StaleTerm):
                # A stage has moved past this frame's term: the pipeline was replaced.
                raise Unavailable(f"the pipeline moved on from term {frame.term}: {error.message}")
            raise error
        self._m_round_ms.labels(frame.kind.value).observe((time.perf_counter() - sent) * 1000.0)
        for timing in result.timings:
            self._m_stage_ms.labels(str(timing.stage_index)).observe(timing.compute_ms)
        return result

    # ---- results from the node (worker thread or Return stream thread) ---------------

    def _on_result(self, result: TokenResult) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._deliver, result)

    def _deliver(self, result: TokenResult) -> None:
        entry = self._waiters.get(result.request_id)
        if entry is None:
            # No frame of this request is waiting: it finished, failed or is recovering.
            reason = "term" if result.term < self._term() else "unclaimed"
            self._m_stale.labels(reason).inc()
            logger.debug("dropped a result for %s: %s", result.request_id, reason)
            return
        waiter, expected = entry
        reason = stale_reason(result, expected)
        if reason is not None:
            self._m_stale.labels(reason).inc()
            logger.warning(
                "request %s: dropped a %s of term %s at position %s (%s mismatch): it "
                "waits for term %s, position %s",
                result.request_id,
                "error" if result.error is not None else "result",
                result.term,
                result.pos_start,
                reason,
                expected.term,
                expected.result_pos,
            )
            return
        if not waiter.done():
            waiter.set_result(result)

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        previous, self._loaded = self._loaded, loaded
        if loaded is not None:
            runtime = loaded.engine.runtime
            self.context_length = runtime.max_tokens_per_session
            self.model_id = PackageManifest.load(loaded.package_dir).model_id
        loop = self._loop
        if previous is not None and loaded is not previous and loop is not None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all, "the pipeline was released")

    def _fail_all(self, reason: str) -> None:
        for waiter, _ in list(self._waiters.values()):
            if not waiter.done():
                waiter.set_exception(Unavailable(reason))
