"""One generation from the HTTP layer's side: drive the backend, produce text.

``GenerationRun`` consumes the backend's async generator inside one dedicated
task (the pump), so the generator never moves between tasks, and stopping is
one operation: ``aclose()`` cancels the pump, which cancels the request in the
backend. The run enforces the token budget and the stop token ids even if a
backend over-delivers (a speculative round past the limit), turns tokens into text
with ``TextStream``, and keeps the numbers for ``usage``, ``timings`` and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mesh.errors import CapacityExceeded, InvalidRequest
from mesh.speculative.prediction import prediction_counts
from stage.frontend.backend import (
    FINISH_REASONS,
    SPECULATION_KEYS,
    GenerationBackend,
    GenerationRequest,
    GenerationStats,
    TokenEvent,
)
from stage.frontend.prepare import PreparedGeneration
from stage.frontend.reasoning import ThoughtTokens
from stage.frontend.telemetry import FrontendMetrics
from stage.frontend.textstream import TextStream

logger = logging.getLogger(__name__)

_END = object()
# The prompt's last tokens the completion's text is decoded after (as context, not
# emitted): enough for a tokenizer to see the word the completion continues.
PROMPT_CONTEXT_TOKENS = 4
CLOSE_TIMEOUT_S = 10.0


class GenerationRun:
    """Drives ``backend.generate`` for one prepared request."""

    def __init__(
        self,
        backend: GenerationBackend,
        prepared: PreparedGeneration,
        tokenizer: Any,
        metrics: FrontendMetrics,
        endpoint: str,
        arrival_s: float,
        request: GenerationRequest | None = None,
        index: int = 0,
        release: Callable[[int], None] | None = None,
    ) -> None:
        self.prepared = prepared
        # Gives back the tenant's slot this generation holds (tenant_slots.py), once.
        self._release = release
        # One choice of the prepared request (``index``: its place in ``choices``).
        self.request = request or prepared.request
        self.index = index
        # With ``echo``: the prompt text put before the completion, and (when the
        # prompt is scored) one mesh.frames.TokenLogprob per prompt token after the
        # first, from the backend's first event.
        self.echo = prepared.echo_of(index)
        self.prompt_logprobs: tuple[Any, ...] = ()
        self.tokenizer = tokenizer
        # (token, mesh.frames.TokenLogprob) of every kept token, when asked for;
        # ``_unsent`` those not yet handed out with a streamed chunk.
        self.logprobs: list[tuple[int, Any]] = []
        self._unsent = 0
        self._backend = backend
        tools = prepared.tools
        self._text = TextStream(
            tokenizer,
            # Stop strings end content, never a tool call's markup: a forced call's
            # answer is all markup, and an offered tool's call is shielded from them.
            () if tools is not None and tools.prefix else prepared.stop,
            skip_special_tokens=prepared.skip_special_tokens,
            include_stop=prepared.include_stop,
            context=self.request.prompt_tokens[-PROMPT_CONTEXT_TOKENS:],
            shield=tools.hold_start if tools is not None else None,
            cut=tools.repeated_call if tools is not None else None,
        )
        self._metrics = metrics
        self._endpoint = endpoint
        self._produced = [metrics.completion_tokens.labels(endpoint=endpoint)]
        tenant = self.request.tenant
        if tenant:
            self._produced.append(metrics.tenant_tokens.labels(tenant=tenant, kind="completion"))
        self._failed = False
        self._refused = False
        self._arrival_s = arrival_s
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._pending: object = None
        self._closed = False
        self._active = False
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        # The completion's token ids, kept for the prediction counts in ``usage``.
        self._output_ids: list[int] = []
        # A reasoning model's thought tokens (usage's reasoning_tokens).
        self.thought = (
            ThoughtTokens(tokenizer, prepared.reasoning) if prepared.reasoning is not None else None
        )
        self._stats: GenerationStats | None = None
        self._submitted_s = 0.0
        self._first_token_s: float | None = None
        self._last_event_s: float | None = None

    async def start(self) -> None:
        """Submit the request and wait for the backend's first event.

        Raises what the backend raised before producing anything (CapacityExceeded,
        Unavailable, InvalidRequest), so the HTTP status is known before a stream starts.
        """
        self._submitted_s = time.perf_counter()
        self._active = True
        self._metrics.active_requests.inc()
        self._task = asyncio.create_task(self._pump(), name=f"generate {self.request.request_id}")
        first = await self._queue.get()
        if isinstance(first, BaseException):
            self._failed = True
            # Refused before anything ran (a full queue's 429, a 400): not a generation
            # that ended in error (mesh_http_requests_total counts it by status).
            self._refused = isinstance(first, CapacityExceeded | InvalidRequest)
            await self.aclose()
            raise first
        if self.index % self.prepared.choices == 0:  # the prompt's other choices share it
            prompt = len(self.request.prompt_tokens)
            self._metrics.prompt_tokens.labels(endpoint=self._endpoint).inc(prompt)
            if self.request.tenant:
                self._metrics.tenant_tokens.labels(tenant=self.request.tenant, kind="prompt").inc(
                    prompt
                )
        if isinstance(first, TokenEvent):
            self.prompt_logprobs = first.prompt_logprobs
            if first.stats is not None:
                self._stats = first.stats
        self._pending = first

    async def _pump(self) -> None:
        try:
            events = self._events()
            try:
                async for event in events:
                    self._queue.put_nowait(event)
                    if event.finish_reason is not None:
                        break
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
            self._queue.put_nowait(_END)
        except Exception as exc:  # handed to the consumer, which maps it to an HTTP answer
            self._queue.put_nowait(exc)

    def _events(self) -> AsyncIterator[TokenEvent]:
        if self.request.max_new_tokens == 0 and not self.request.score_prompt:
            # ``echo`` with ``max_tokens`` 0 and no ``logprobs``: the answer is the
            # prompt's text; the engine has nothing to read, score or generate.
            return _nothing_to_generate()
        return self._backend.generate(self.request)

    def take_logprobs(self) -> list[tuple[int, Any]]:
        """The log-probabilities of tokens not handed out yet (for a streamed chunk)."""
        fresh = self.logprobs[self._unsent :]
        self._unsent = len(self.logprobs)
        return fresh

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._text.stop_string

    async def next_text(self) -> str | None:
        """The next piece of completion text ('' when tokens completed no text yet), or
        None once the generation has finished. Raises the backend's mid-stream errors."""
        if self.finish_reason is not None:
            return None
        if self._pending is not None:
            item, self._pending = self._pending, None
        else:
            item = await self._queue.get()
        if isinstance(item, BaseException):
            self._failed = True
            await self.aclose()
            raise item
        if item is _END:
            logger.warning(
                "backend ended request %s without a finish reason; reporting 'stop'",
                self.request.request_id,
            )
            self.finish_reason = "stop"
            text = self._text.finish()
        else:
            assert isinstance(item, TokenEvent)
            text = self._consume(item)
        if self.finish_reason is not None:
            await self.aclose()
        return text

    def _consume(self, event: TokenEvent) -> str:
        now = time.perf_counter()
        self._last_event_s = now
        if event.stats is not None:
            self._stats = event.stats
        finish: str | None = None
        ids = list(event.token_ids)
        for index, token in enumerate(ids):
            if token in self.request.stop_token_ids:
                ids, finish = ids[:index], "stop"
                break
        room = self.request.max_new_tokens - self.completion_tokens
        if len(ids) >= room:
            ids = ids[:room]
            finish = finish or "length"
        if ids:
            if self._first_token_s is None:
                self._first_token_s = now
                self._metrics.time_to_first_token.labels(endpoint=self._endpoint).observe(
                    now - self._arrival_s
                )
        text = ""
        for index, token in enumerate(ids):
            # One token at a time: when a stop string ends inside a multi-token
            # (speculative) event, the tokens after the one completing it are not counted.
            text += self._text.push([token])
            if self._text.stopped:
                ids = ids[: index + 1]
                break
        self.completion_tokens += len(ids)
        if self.request.prediction_tokens is not None:
            self._output_ids += ids
        if self.thought is not None:
            for token in ids:
                self.thought.push(token)
        for counter in self._produced:
            counter.inc(len(ids))
        if event.logprobs:
            self.logprobs += zip(ids, event.logprobs[: len(ids)], strict=False)
        if self._text.stopped:
            finish = "stop"
        elif finish is None and event.finish_reason is not None:
            finish = event.finish_reason
            if finish not in FINISH_REASONS:
                logger.warning("backend sent unknown finish reason %r; reporting 'stop'", finish)
                finish = "stop"
        if finish is not None:
            text += self._text.finish()
            # The flushed text (an incomplete character at the end, as U+FFFD) can
            # complete a stop string: then a stop string ended the answer.
            self.finish_reason = "stop" if self._text.stopped else finish
        return text

    async def aclose(self) -> None:
        """Stop the generation (cancelling it in the backend) and record its metrics."""
        if self._closed:
            return
        self._closed = True
        if self._release is not None:
            self._release(self.completion_tokens)
        task = self._task
        if task is not None:
            if not task.done():
                task.cancel()
            done, _ = await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                logger.warning(
                    "backend did not finish cancelling request %s within %.0f s",
                    self.request.request_id,
                    CLOSE_TIMEOUT_S,
                )
            elif not task.cancelled() and task.exception() is not None:
                logger.error("generation pump failed: %s", task.exception())
        if self._active:
            self._active = False
            self._metrics.active_requests.dec()
            if not self._refused:
                reason = self._end()
                self._metrics.generations.labels(endpoint=self._endpoint, reason=reason).inc()
            if self.completion_tokens >= 2 and self._first_token_s and self._last_event_s:
                per_token = (self._last_event_s - self._first_token_s) / (
                    self.completion_tokens - 1
                )
                self._metrics.time_per_output_token.labels(endpoint=self._endpoint).observe(
                    per_token
                )

    def _end(self) -> str:
        """How the generation ended, for ``mesh_generations_total``."""
        if self.finish_reason is None:
            return "error" if self._failed else "cancelled"
        if self.finish_reason == "stop" and self.stop_string is not None:
            return "stop_string"
        return self.finish_reason

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a kept prefix spared the pipeline (the prefix cache)."""
        return self._stats.cached_tokens if self._stats is not None else 0

    def usage(self) -> dict[str, Any]:
        prompt = len(self.request.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        } | self._completion_details()

    @property
    def reasoning_tokens(self) -> int | None:
        """Output tokens of a reasoning model's thought (None: not counted)."""
        return self.thought.count if self.thought is not None else None

    def _completion_details(self) -> dict[str, Any]:
        """OpenAI's prediction counts, when the request sent a prediction, and the
        thought's tokens, when they are counted."""
        details: dict[str, int] = {}
        prediction = self.request.prediction_tokens
        if prediction is not None:
            accepted, rejected = prediction_counts(prediction, self._output_ids)
            details["accepted_prediction_tokens"] = accepted
            details["rejected_prediction_tokens"] = rejected
        if self.reasoning_tokens is not None:
            details["reasoning_tokens"] = self.reasoning_tokens
        return {"completion_tokens_details": details} if details else {}

    def timings(self) -> dict[str, float]:
        """llama.cpp-style timings; the backend's numbers when it sent any."""
        stats = self._stats
        if stats is not None:
            prompt_n, prompt_ms = stats.prompt_tokens, stats.prompt_ms
            predicted_ms = stats.decode_ms
        else:
            first = self._first_token_s or self._last_event_s or self._submitted_s
            last = self._last_event_s or first
            prompt_n = len(self.request.prompt_tokens)
            prompt_ms = (first - self._submitted_s) * 1000.0
            predicted_ms = (last - first) * 1000.0
        predicted_n = self.completion_tokens
        timings: dict[str, float] = {
            "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "predicted_n": predicted_n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": (
                round(predicted_n * 1000.0 / predicted_ms, 3) if predicted_ms > 0 else 0.0
            ),
        }
        if stats is not None:
            for key in SPECULATION_KEYS:
                if key in stats.speculation:
                    timings[key] = stats.speculation[key]
        return timings


async def _nothing_to_generate() -> AsyncIterator[TokenEvent]:
    yield TokenEvent((), "length")
