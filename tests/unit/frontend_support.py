"""Test support for the HTTP frontend: real in-process backends and a live server.

``TinyModelBackend`` runs a tiny random HF model (SmolLM2's tokenizer) with a real
KV cache and ``mesh.sampling.sample_token`` in a worker thread per request, the
way the engine runs behind the frontend, and records every request it saw closed.
It scores prompts (``score_prompt``) from the rows of the prompt's forward pass.
``ScriptedBackend`` replays fixed events, for the engine-contract edge cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from mesh.errors import CapacityExceeded, MeshError
from mesh.frames import TokenLogprob
from mesh.sampling import sample_token, token_logprob
from stage.frontend.app import create_app
from stage.frontend.backend import GenerationRequest, GenerationStats, TokenEvent
from stage.frontend.http_server import serve_app, stop_server
from stage.frontend.telemetry import FrontendMetrics

MODEL_ID = "tiny-llama"


class ClosedLog:
    """Thread-safe record of the request ids a backend saw closed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ids: list[str] = []

    def add(self, request_id: str) -> None:
        with self._cond:
            self._ids.append(request_id)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> list[str]:
        """Wait until ``count`` requests were closed; return all closed ids."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._ids) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._ids)

    @property
    def ids(self) -> list[str]:
        with self._cond:
            return list(self._ids)


class TinyModelBackend:
    """A real, in-process GenerationBackend over a tiny HF causal LM."""

    def __init__(
        self, model_dir: Path, *, model_id: str = MODEL_ID, max_sessions: int = 16
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model_id = model_id
        self.context_length = int(self.model.config.max_position_embeddings)
        self.max_sessions = max_sessions
        self.step_delay_s = 0.0
        self.fail_with: MeshError | None = None
        self.requests: list[GenerationRequest] = []
        self.closed = ClosedLog()
        self._ready = True
        self._reason: str | None = None
        # How long a request waits for a reload (the scheduler's recovery timeout).
        self.reload_wait_s = 0.0
        self.waiting = 0
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()

    def set_ready(self, ready: bool, reason: str | None = None) -> None:
        self._ready, self._reason = ready, reason

    def ready(self) -> bool:
        return self._ready

    async def wait_ready(self) -> bool:
        """Waits up to ``reload_wait_s`` (0: answers at once) for ``set_ready(True)``;
        ``waiting`` counts the requests in here now."""
        deadline = time.monotonic() + self.reload_wait_s
        self.waiting += 1
        try:
            while not self._ready and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            self.waiting -= 1
        return self._ready

    def unavailable_reason(self) -> str | None:
        return None if self._ready else (self._reason or "loading layers")

    @property
    def active_count(self) -> int:
        """Requests the backend is generating for now."""
        with self._lock:
            return len(self._active)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            if len(self._active) >= self.max_sessions:
                raise CapacityExceeded(
                    f"all {self.max_sessions} sessions are busy; retry after Retry-After"
                )
            self._active.add(request.request_id)
            self.requests.append(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()
        worker = threading.Thread(
            target=self._decode, args=(request, loop, queue, cancel), daemon=True
        )
        worker.start()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenEvent)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancel.set()
            with self._lock:
                self._active.discard(request.request_id)
            self.closed.add(request.request_id)

    def _forward(self, ids: list[int], past: Any) -> tuple[torch.Tensor, Any]:
        """Every position's row of logits, and the cache."""
        with self._forward_lock, torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
        return out.logits[0], out.past_key_values

    def _decode(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[object],
        cancel: threading.Event,
    ) -> None:
        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, item)

        try:
            started = time.perf_counter()
            rows, past = self._forward(list(request.prompt_tokens), None)
            logits = rows[-1]
            # Handed out with the first event only.
            scores = prompt_scores(request, rows) if request.score_prompt else ()
            prompt_ms = (time.perf_counter() - started) * 1000.0
            decode_started = time.perf_counter()
            position = len(request.prompt_tokens)
            produced = 0
            if request.max_new_tokens == 0:
                stats = GenerationStats(len(request.prompt_tokens), 0, prompt_ms, 0.0)
                emit(TokenEvent((), "length", stats, prompt_logprobs=scores))
                return
            while not cancel.is_set():
                token = sample_token(logits, request.sampling, position)
                stats = GenerationStats(
                    prompt_tokens=len(request.prompt_tokens),
                    completion_tokens=produced,
                    prompt_ms=prompt_ms,
                    decode_ms=(time.perf_counter() - decode_started) * 1000.0,
                )
                if token in request.stop_token_ids:
                    emit(TokenEvent((), "stop", stats, prompt_logprobs=scores))
                    return
                produced += 1
                done = produced >= request.max_new_tokens
                logprobs = ()
                if request.sampling.top_logprobs >= 0:
                    logprobs = (TokenLogprob(*token_logprob(logits, request.sampling, token)),)
                emit(TokenEvent((token,), "length" if done else None, stats, logprobs, scores))
                scores = ()
                if done:
                    return
                if self.step_delay_s and cancel.wait(self.step_delay_s):
                    return
                rows, past = self._forward([token], past)
                logits = rows[-1]
                position += 1
        except Exception as exc:  # handed to the request's consumer
            emit(exc)


def prompt_scores(request: GenerationRequest, rows: torch.Tensor) -> tuple[TokenLogprob, ...]:
    """The prompt's scores from its forward pass's ``rows`` of raw logits: entry i is
    prompt token i + 1's log-probability given the tokens before it, with the
    ``sampling.top_logprobs`` likeliest tokens of the same row."""
    logprobs = torch.log_softmax(rows[:-1].float(), dim=-1)
    count = max(request.sampling.top_logprobs, 0)
    scores = []
    for row, token in zip(logprobs, request.prompt_tokens[1:], strict=True):
        values, indices = torch.topk(row, count)
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
        scores.append(TokenLogprob(float(row[token]), top))
    return tuple(scores)


class ScriptedBackend:
    """Replays a fixed list of events (or raises) for every request."""

    model_id = MODEL_ID
    context_length = 512

    def __init__(self, events: Sequence[TokenEvent | BaseException]) -> None:
        self.events = list(events)
        self.closed = ClosedLog()
        self.requests: list[GenerationRequest] = []

    def ready(self) -> bool:
        return True

    def unavailable_reason(self) -> str | None:
        return None

    async def wait_ready(self) -> bool:
        return True

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append(request)
        try:
            for item in self.events:
                await asyncio.sleep(0)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed.add(request.request_id)


@contextlib.contextmanager
def live_server(
    backend: Any, tokenizer: Any, *, internal_errors: int = 0, **app_kwargs: Any
) -> Iterator[str]:
    """Serve the frontend on 127.0.0.1 (OS-chosen port); yield its base URL.

    Fails the test unless exactly ``internal_errors`` requests reached the catch-all
    (an unexpected exception): zero for anything a user can send.
    """
    app_kwargs.setdefault("model_id", MODEL_ID)
    metrics = app_kwargs.setdefault("metrics", FrontendMetrics())
    app = create_app(backend, tokenizer, **app_kwargs)
    server, thread, port = serve_app(app, "127.0.0.1", 0)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code in (200, 503):
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
        yield base_url
    finally:
        stop_server(server, thread)
    seen = metrics.registry.get_sample_value("mesh_http_internal_errors_total")
    assert seen == internal_errors, f"{seen} requests reached the catch-all 500 handler"


def metric_value(metrics_text: str, name: str, labels: str = "") -> float:
    """The value of one sample line of a Prometheus text body (0 when absent)."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def assert_openai_error(
    response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """Assert an OpenAI-shaped error body with this status (and code/param if given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def sentencepiece_style() -> Any:
    """A Llama-2-style tokenizer: spaces as ▁, bytes outside the vocabulary as
    <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"▁": 259, "h": 260, "i": 261, "▁h": 262, "hi": 263, "▁hi": 264}
    merges = [("▁", "h"), ("h", "i"), ("▁h", "i")]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
