"""Stage 0's generation backend: the asyncio side of the engine core.

Every request's tokens come from the engine core's step loop
(stage/frontend/engine_core.py), which packs the segments of all running requests
into frames. This class feeds it: requests from the HTTP layer, results from the
node (worker thread or Return stream, handed over to the event loop), the loaded
pipeline, and a clock tick for timeouts and recoveries; it submits the frames the
core packs to the node and hands each request's events to its consumer. Stage 0's
own layers run on the node's worker thread, later stages in their own processes, so
up to one frame per stage is in the pipe at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any

from mesh.config import WindowPolicySpec
from mesh.errors import MeshError, Unavailable
from mesh.frames import Frame, FrameResult, Segment
from mesh.grammar import TokenGrammars
from mesh.package.manifest import PackageManifest
from mesh.settings.sections import CoordinatorConfig
from mesh.speculative import DrafterFactory, Telemetry, make_policy
from mesh.speculative.prediction import PredictionDrafter
from mesh.types import RESTART_GRACE_S, STALL_ROUND_FACTOR
from stage.frontend.backend import GenerationRequest, TokenEvent
from stage.frontend.engine_core import EngineCore
from stage.frontend.engine_metrics import EngineMetrics
from stage.frontend.engine_types import EngineLimits, Outcome, PipelineInfo
from stage.frontend.request_run import RequestRun
from stage.frontend.status import PipelineActivity
from stage.node import LoadedStage, StageNode, WaitingFrame

logger = logging.getLogger(__name__)

TICK_S = 0.1
# How often a request that arrived during a reload looks for the new pipeline.
READY_POLL_S = 0.05
# The widest window a request with a prediction may be given.
PREDICTION_MAX_WINDOW = 32


def stall_deadline_s(
    stall_timeout_s: float, longest_round_s: float, compute_s: float, stages: int
) -> float:
    """How long stage 0 waits for a frame's answer before its local stall rule holds:
    the larger of the coordinator's stall timeout and STALL_ROUND_FACTOR times the
    round the frame should take, which is the longest recent round or, when longer,
    stage 0's own compute time for the frame times the stage count (a long prompt
    chunk takes about that long on every stage)."""
    expected_s = max(longest_round_s, compute_s * max(1, stages))
    return max(stall_timeout_s, STALL_ROUND_FACTOR * expected_s)


class PipelineScheduler:
    """Implements the HTTP layer's GenerationBackend over a stage-0 StageNode."""

    def __init__(self, node: StageNode, model_id: str, limits: EngineLimits) -> None:
        self.node = node
        self.speculation: DrafterFactory | None = None
        # What the operator should know about the speculation in use (a package
        # block left out, a draft that fell back to n-gram, clamped windows).
        self.speculation_notes: tuple[str, ...] = ()
        self.detokenize: Callable[[Sequence[int]], str] | None = None
        self.telemetry_totals: dict[str, Telemetry] = {}
        self.model_id = model_id
        self.context_length = 0
        self.limits = limits
        # The coordinator's stall timeout (sent with each Load; 0: the rule is off),
        # for the local stall rule (``_stalled_reason``).
        self.stall_timeout_s = CoordinatorConfig.stall_timeout
        self._stalled = False
        # When the coordinator answered again while the rule held (None: it has not).
        self._coordinator_back_at: float | None = None
        self.core = EngineCore(limits, time.perf_counter, self._new_speculation)
        # What the status page shows of the pipeline's recent work.
        self.activity = PipelineActivity(time.perf_counter)
        self._loaded: LoadedStage | None = None
        # The served model's grammar compiler, for checking a request's constraint
        # before it is queued.
        self._grammars: TokenGrammars | None = None
        # Whether a pipeline was ever loaded: then a missing one is being reloaded.
        self._served = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._runs: dict[str, RequestRun] = {}
        self._ticker: asyncio.Task | None = None
        self.metrics = EngineMetrics(node.metrics.registry, self)
        node.set_result_sink(self._on_result)
        node.on_load_change(self._on_load_change)
        node.on_link_reopened(self._on_link_reopened)
        # A reload that only pays while stage 0 is idle (a rebalance) is refused
        # while generations run or wait here.
        node.busy = lambda: len(self._queues)

    @property
    def recoveries(self) -> int:
        return self.core.recoveries

    # ---- GenerationBackend ---------------------------------------------------------

    def ready(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """Why this frontend cannot answer now (None: it can): no pipeline loaded, or
        the data link to the next stage broke (that stage died, or the network
        between them; the coordinator plans a new pipeline, and until then nothing
        sent down would come back; while no coordinator can be reached the stages
        open the link again once every stage of the term answers:
        ``StageNode._repair``)."""
        loaded = self._loaded
        if loaded is None:
            return "the pipeline is not loaded yet (or is reloading after a stage was lost)"
        return self._broken_reason() or self._stalled_reason()

    def _broken_reason(self) -> str | None:
        """Why the loaded pipeline is broken: stage 0's Forward link is (None: it is not)."""
        loaded = self._loaded
        if loaded is None or not loaded.link_error:
            return None
        if loaded.forward is None or not loaded.forward.broken:
            return None
        if self.node.coordinator_outage() > 0:
            return (
                f"the pipeline is broken ({loaded.link_error}) and the coordinator cannot "
                "be reached: waiting for the stages to open the link again (or for the "
                "coordinator to load a new pipeline)"
            )
        return (
            f"the pipeline is broken ({loaded.link_error}); waiting for the coordinator "
            "to load a new one"
        )

    def _stalled_reason(self) -> str | None:
        """The local stall rule, while the coordinator cannot be reached (so nothing
        will plan around the stage that holds a frame: a hung stage, a link that
        drops its packets): the oldest frame still waiting for its answer has waited
        past the coordinator's stall deadline (``stall_deadline_s``), or a frame went
        unanswered past the round timeout and no answer of the term came since. New
        requests wait for the pipeline as during a reload and /health says 503 with
        this reason. Running requests keep waiting: if the stage wakes they go on
        where they were, or, once the round timeout gave their frames up, read their
        tokens again on the same pipeline (``EngineCore._answers_again``).

        A coordinator that answers again while the rule holds takes the judgement
        over, but not at once: a restarted one waits for the stages to join again, a
        paused one judges silence from the moment it runs again. So the rule keeps
        holding for up to the stall timeout plus a restarted coordinator's grace
        (``RESTART_GRACE_S``) after the coordinator answers (less when the frame is
        answered or the coordinator loads a new pipeline first): before, /health said
        200 in between and new requests joined the stuck pipeline."""
        if self.stall_timeout_s <= 0:
            return None
        outage_s = self.node.coordinator_outage()
        if outage_s > 0:
            self._coordinator_back_at = None
            alone = f"the coordinator has been unreachable for {outage_s:.0f} s"
        elif not self._stalled:
            return None
        else:
            now = time.perf_counter()
            if self._coordinator_back_at is None:
                self._coordinator_back_at = now
            back_s = now - self._coordinator_back_at
            if back_s >= self.stall_timeout_s + RESTART_GRACE_S:
                return None
            alone = (
                f"the coordinator, reachable again for {back_s:.0f} s, has not planned "
                "around it yet"
            )
        info = self.core.info
        if (
            info is not None
            and self.core.unanswered_term == info.term
            and self.core.recovering(info.term)
        ):
            # Past the round timeout the frames are given up (nothing waits any more)
            # but the pipeline has not answered since: it is still stuck. While the
            # requests that lost them wait to resume (an answer of the term resumes
            # them); after that new requests go in again, or nothing could ever show
            # that the pipeline moves (no answer comes while nothing runs).
            return (
                f"a frame of term {info.term} got no answer within the round timeout "
                f"({self.limits.round_timeout_s:.0f} s) and none has come since, and "
                f"{alone}, so nothing can plan around the stage that holds it: waiting "
                "for the pipeline to answer again or for the coordinator"
            )
        waiting = self.node.waiting
        if waiting is None:
            return None
        waited_s = time.perf_counter() - waiting.sent_at
        loaded = self.node.loaded
        compute_s = loaded.compute_s.get(waiting.frame_id, 0.0) if loaded is not None else 0.0
        deadline_s = stall_deadline_s(
            self.stall_timeout_s,
            waiting.longest_round_s,
            compute_s,
            info.stage_count if info is not None else 1,
        )
        if waited_s < deadline_s:
            return None
        return (
            f"no answer from the pipeline for {waited_s:.0f} s (frame {waiting.frame_id}; "
            f"stall deadline {deadline_s:.0f} s) and {alone}, so nothing can plan around "
            "the stage that holds it: waiting for that stage to answer or for the "
            "coordinator"
        )

    def _stall_ended(self) -> str:
        """Why the local stall rule stopped holding, as the log says it."""
        if self.node.coordinator_outage() <= 0:
            return (
                "the coordinator is reachable again (it plans around the stalled stage "
                "when it finds it stalled)"
            )
        broken = self._broken_reason()
        if broken is not None:
            return f"the frame it waited for was given up; {broken}"
        return "the pipeline answers again"

    async def wait_ready(self) -> bool:
        """Ready now, or (while a pipeline that served is reloaded) once the new one is
        loaded, within the time a running request waits for it (``limits.
        recovery_timeout_s``): a request that arrives during a reload is served
        after it, as the requests it interrupted are. Ready means the engine core on
        this loop has the pipeline too (a Load's thread sets the node's first)."""
        if self._serving() or not self._served:
            return self._serving()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.recovery_timeout_s
        while not self._serving() and loop.time() < deadline:
            await asyncio.sleep(READY_POLL_S)
        return self._serving()

    @property
    def vocab_size(self) -> int:
        """Rows of the loaded model's embedding (0 before a load)."""
        loaded = self._loaded
        return loaded.engine.runtime.vocab_size if loaded is not None else 0

    @property
    def active_requests(self) -> int:
        """Generations running or queued now (each choice of a request is one)."""
        return len(self._queues)

    @property
    def request_capacity(self) -> int:
        """Requests (each choice of a request is one) admitted at once: running and
        queued; one request's choices beyond it could never all be admitted."""
        return self.limits.max_sessions + self.limits.max_queued

    def _serving(self) -> bool:
        """A pipeline is loaded, the engine core has it, and its link holds: a request
        that arrives while the link is broken waits for the next pipeline as during a
        reload, rather than joining requests that wait for answers that cannot come."""
        return (
            self._loaded is not None
            and self.core.info is not None
            and self.unavailable_reason() is None
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        self._attach(asyncio.get_running_loop())
        if self._loaded is None:
            raise Unavailable(self.unavailable_reason() or "not ready")
        if request.sampling.grammar:
            # Before anything is queued: a grammar the library cannot follow is the
            # request's 400 now, not an error the last stage finds mid-stream.
            await asyncio.to_thread(self.check_grammar, request.sampling.grammar)
        run = self.core.add(request)
        request_id = request.request_id
        events: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = events
        self._runs[request_id] = run
        self._pump()
        try:
            while True:
                item = await events.get()
                if isinstance(item, MeshError):
                    raise item
                if item.finish_reason is not None:
                    # Before the last yield: the consumer may close the generator there.
                    self._finish(run)
                    yield item
                    return
                yield item
        finally:
            self._queues.pop(request_id, None)
            if run.drafter is not None:
                # However it ended (stop, stop string, client gone, error), its tokens
                # so far are what it committed.
                run.drafter.finish()
            self._runs.pop(request_id, None)
            self.core.cancel(request_id)
            self._pump()

    def check_grammar(self, spec: str) -> None:
        """Compile ``spec`` with the served model's tokenizer and walk its first
        tokens, as the last stage will (InvalidRequest where the library cannot
        follow it); the compiled grammar is kept for the next request with the same
        spec. Blocks (the tokenizer's first build takes a second or more): call it
        off the event loop."""
        loaded = self._loaded
        if loaded is None:
            return
        self._checker(loaded).check(spec, loaded.engine.runtime.vocab_size)

    def _checker(self, loaded: LoadedStage) -> TokenGrammars:
        """The grammar compiler stage 0 checks constraints with: the last stage's own
        when stage 0 is also the last stage (one tokenizer build, one cache), else
        one of its own for the loaded package."""
        if loaded.engine.grammars is not None:
            return loaded.engine.grammars
        grammars = self._grammars
        if grammars is None or grammars.tokenizer_dir != loaded.package_dir:
            grammars = self._grammars = TokenGrammars(loaded.package_dir)
        return grammars

    def end_all(self, message: str) -> None:
        """End every running generation with a 503 saying ``message`` (the process is
        stopping before they finished); safe from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def end() -> None:
            for events in self._queues.values():
                events.put_nowait(Unavailable(message))

        loop.call_soon_threadsafe(end)

    # ---- the loop side ---------------------------------------------------------------

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop and self._ticker is not None:
            return
        self._loop = loop
        self._ticker = loop.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._dispatch(self.core.expire())
                self._pump()
                self._note_waiting()
            except Exception:  # noqa: BLE001 - the timer must outlive any one tick
                # An exception here would end the task silently, and with it every
                # round timeout and recovery deadline of this process.
                logger.exception("the engine's timer tick failed; it goes on")

    def _note_waiting(self) -> None:
        """Tell the node (for its heartbeats) which frame has waited longest for an
        answer; log when the local stall rule starts or stops holding."""
        info, waiting = self.core.info, self.core.oldest_unanswered()
        if info is None or waiting is None:
            self.node.waiting = None
        else:
            frame_id, sent_at, longest_s = waiting
            self.node.waiting = WaitingFrame(info.term, frame_id, sent_at, longest_s)
        reason = self._stalled_reason()
        if (reason is not None) != self._stalled:
            self._stalled = reason is not None
            if reason is not None:
                logger.warning("new requests wait and /health says 503: %s", reason)
            else:
                logger.info("the local stall rule no longer holds: %s", self._stall_ended())

    def _pump(self) -> None:
        """Submit frames while the core has work and the pipe has room; new prompts
        join the frame of new prompts still waiting for stage 0's worker."""
        while (frame := self.core.next_frame()) is not None:
            self._send(frame)
        frame_id = self.core.open_prompts_frame()
        if frame_id:
            joined: list[Segment] = []

            def join() -> list[Segment]:
                joined.extend(self.core.join_prompts_frame(frame_id))
                return joined

            if self.node.amend(frame_id, join):
                self.metrics.segments_joined(joined)

    def _send(self, frame: Frame) -> None:
        self.metrics.frame_sent(frame)
        self.node.submit(frame)

    def _dispatch(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            run = self._runs.get(outcome.request_id)
            if run is not None:
                self._count_rounds(run)
            events = self._queues.get(outcome.request_id)
            if events is not None:
                events.put_nowait(outcome.error if outcome.error is not None else outcome.event)
        self.metrics.stale(self.core.stale)
        self.core.stale.clear()

    def _count_rounds(self, run: RequestRun) -> None:
        """Add the decode rounds ``run`` committed since last time to the speculation
        counters and ``telemetry_totals`` (however the request ends later)."""
        rounds = self.metrics.rounds(run)
        if rounds is not None:
            self.telemetry_totals[run.strategy] = (
                self.telemetry_totals.get(run.strategy, Telemetry()) + rounds
            )

    def _new_speculation(self, request: GenerationRequest):
        """The request's drafter, window policy and strategy name: the server's, or
        drafting from the request's prediction first (Predicted Outputs, with the
        server's drafter where the prediction has nothing); none when the request
        turned speculation off."""
        factory = self.speculation
        if not request.speculation or (factory is None and request.prediction_tokens is None):
            return None
        drafter = factory.new_drafter(scope=request.scope) if factory is not None else None
        spec = factory.config.window_policy if factory is not None else WindowPolicySpec()
        name = factory.name if factory is not None else ""
        if request.prediction_tokens is not None:
            drafter = PredictionDrafter(request.prediction_tokens, drafter)
            # A prediction is worth long windows; the policy still weighs their cost.
            spec = replace(spec, max_window=max(spec.max_window, PREDICTION_MAX_WINDOW))
            name = "prediction"
        text = self.detokenize(request.prompt_tokens) if self.detokenize else None
        drafter.begin(request.prompt_tokens, prompt_text=text)
        return drafter, make_policy(spec), name

    def _finish(self, run: RequestRun) -> None:
        telemetry = run.telemetry
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

    # ---- from the node (worker thread or Return stream thread) ------------------------

    def _on_result(self, result: FrameResult) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._deliver, result)

    def _deliver(self, result: FrameResult) -> None:
        if result.reopened:
            why = f"a stage opened its {result.reopened_link or 'return'} link again"
            self._reopened(result.term, why, answered_upto=result.frame_id)
            return
        sent = self.core.frames.get(result.frame_id)
        outcomes = self.core.on_result(result)
        # The next frame first: stage 0's worker computes it while this thread does
        # the bookkeeping and hands the tokens to their requests.
        self._pump()
        self.metrics.result_received(sent, result)
        self.activity.observe(result, sent, outcomes)
        self._dispatch(outcomes)

    def speculation_summary(self) -> dict[str, Any]:
        """The speculation stage 0 serves with, for ``/v1/models`` and status."""
        factory = self.speculation
        notes = list(self.speculation_notes)
        if factory is not None and factory.fallback_reason:
            notes.append(factory.fallback_reason)
        return {"strategy": factory.name if factory is not None else "none", "notes": notes}

    def set_limits(self, limits: EngineLimits) -> None:
        """Apply new engine limits on the event loop (called from a Load's thread)."""
        self.limits = limits
        loop = self._loop
        if loop is None or loop.is_closed():
            self.core.set_limits(limits)
        else:
            loop.call_soon_threadsafe(self.core.set_limits, limits)

    def _on_load_change(self, loaded: LoadedStage | None) -> None:
        self._loaded = loaded
        self._served = self._served or loaded is not None
        info = None
        if loaded is not None:
            runtime = loaded.engine.runtime
            checker = self._checker(loaded)
            if checker is not loaded.engine.grammars:  # the last stage's warms itself
                checker.warm(runtime.vocab_size)
            self.context_length = runtime.max_tokens_per_session
            self.model_id = PackageManifest.load(loaded.package_dir).model_id
            info = PipelineInfo(
                term=loaded.request.term,
                stage_count=loaded.request.stage_count,
                model_id=self.model_id,
                context_length=self.context_length,
                step_tokens=loaded.request.max_batch_tokens,
                kv_sessions=runtime.max_sessions,
                session_idle_s=loaded.request.session_idle_timeout_s,
            )
        loop = self._loop
        if loop is None or loop.is_closed():
            self.core.set_pipeline(info)
            return
        loop.call_soon_threadsafe(self._set_pipeline, info)

    def _on_link_reopened(self, loaded: LoadedStage, kind: str) -> None:
        """Stage 0 opened its broken Forward link again (``StageNode._repair``): the
        requests the break failed read their tokens again on the same pipeline."""
        why = f"stage 0 opened its {kind} link again"
        loop = self._loop
        if loop is None or loop.is_closed():
            self._reopened(loaded.request.term, why)
        else:
            loop.call_soon_threadsafe(self._reopened, loaded.request.term, why)

    def _reopened(self, term: int, why: str, answered_upto: int = 0) -> None:
        """A link of ``term`` is open again (``EngineCore.links_reopened``); the lost
        requests read their tokens again only once stage 0's own Forward link is
        whole (a note of a Return link opened again may come first)."""
        loaded = self._loaded
        resume = loaded is None or loaded.forward is None or not loaded.forward.broken
        self.core.links_reopened(term, why, answered_upto, resume)
        self._pump()

    def _set_pipeline(self, info: PipelineInfo | None) -> None:
        self._dispatch(self.core.set_pipeline(info))
        self._pump()
