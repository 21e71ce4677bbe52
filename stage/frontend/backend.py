"""The contract between the OpenAI HTTP layer and the generation engine behind it.

The HTTP layer turns an OpenAI request into a ``GenerationRequest`` (prompt token
ids, a token budget already clamped to the context, sampling parameters with a
concrete seed, and the stop token ids), calls ``backend.generate(request)`` and
iterates the async generator it returns. Everything about text (chat template,
detokenisation, stop strings) stays in the HTTP layer; the engine deals in token
ids only.

Generator contract:

- ``generate`` returns an async generator. Admission errors are raised on the first
  ``__anext__`` (or by ``generate`` itself): ``mesh.errors.CapacityExceeded`` when the
  session limit is reached (HTTP 429), ``mesh.errors.Unavailable`` while the pipeline
  cannot serve (HTTP 503), ``mesh.errors.InvalidRequest`` for input the engine
  refuses (HTTP 400). A ``MeshError`` raised after tokens were sent ends the stream
  with an OpenAI error event.
- With ``score_prompt`` the first event carries the prompt's log-probabilities,
  with ``pooling`` its pooled hidden state (embeddings); with ``max_new_tokens`` 0
  it is also the last (no token ids, ``"length"``).
- Each ``TokenEvent`` carries one or more newly committed token ids (a speculative
  round may commit several at once). ``token_ids`` never contains the stop token
  that ended generation; that is reported as ``finish_reason="stop"``. Reaching
  ``max_new_tokens`` is reported as ``finish_reason="length"``. The event with a
  finish reason is the last one; it may have no token ids.
- Any event may carry ``stats``, a cumulative ``GenerationStats`` snapshot; the HTTP
  layer keeps the latest one it saw, so a request ended early by a stop string still
  reports the counters as of its last consumed token. The final event should carry
  one. Without any, the HTTP layer measures prompt and decode time itself.
- The HTTP layer consumes the generator inside one asyncio task. It stops early (a
  stop string, a client disconnect, a server shutdown) by cancelling that task or by
  calling ``aclose()``: the backend must then cancel the request and free its KV on
  every stage, in a ``finally`` block of the generator.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mesh.types import SamplingParams

FINISH_REASONS = frozenset({"stop", "length"})
# How an embedding pools a prompt's rows (``GenerationRequest.pooling``).
POOLINGS = ("mean", "last")

# Keys the HTTP layer copies from GenerationStats.speculation into `timings`.
SPECULATION_KEYS = (
    "drafted",
    "accepted",
    "accept_rate",
    "windows",
    "tokens_per_round",
    # With windows drafted ahead of their verdicts (docs/speculation.md).
    "windows_ahead",
    "windows_dropped",
    "wasted_tokens",
    "depth",
)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as the engine sees it."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    # With n > 1: the request of the first choice, whose prompt this one shares (its
    # session starts from a copy of that session's prompt positions).
    fork_of: str = ""
    # Whose earlier requests may shape this one's drafts: the tenant (its API key)
    # and, within it, the request's ``user``. Never changes output.
    scope: str = ""
    # The tenant its API key names ("" without keys): kept prefixes are shared only
    # within a tenant (mesh/api_keys.py), and within it among requests of the same
    # ``cache_salt`` (an extension).
    tenant: str = ""
    cache_salt: str = ""

    @property
    def prefix_partition(self) -> str:
        """Whose kept prefixes this request may start from, and leaves its own to."""
        return f"{self.tenant}\x00{self.cache_salt}" if self.cache_salt else self.tenant

    # OpenAI's Predicted Outputs: the tokens the client expects back (None: none).
    prediction_tokens: tuple[int, ...] | None = None
    # Per-request speculation control (an extension): off, or a cap on the window
    # (0: the server's policy alone).
    speculation: bool = True
    max_window: int = 0
    # Score the prompt (``echo`` with ``logprobs`` on completions): the first event
    # carries ``prompt_logprobs``. Only then may ``max_new_tokens`` be 0 (the prompt
    # is read and scored, nothing is generated).
    score_prompt: bool = False
    # Embeddings: pool the prompt's rows of the model's final-normed hidden state,
    # "mean" or "last" ("": none); the first event carries ``embedding``. Only then
    # (or with ``score_prompt``) may ``max_new_tokens`` be 0.
    pooling: str = ""

    @property
    def reads_only(self) -> bool:
        """True when the request may read its prompt and generate nothing."""
        return self.score_prompt or bool(self.pooling)


@dataclass(frozen=True)
class GenerationStats:
    """Cumulative counters of one generation.

    ``speculation`` holds any of ``drafted``, ``accepted`` (draft tokens proposed and
    accepted), ``accept_rate`` (accepted / drafted), ``windows`` (verify rounds) and
    ``tokens_per_round``; it is empty when speculation was off.
    """

    prompt_tokens: int
    completion_tokens: int
    prompt_ms: float
    decode_ms: float
    speculation: Mapping[str, float] = field(default_factory=dict)
    # Prompt tokens whose prefill a kept prefix saved (the prefix cache).
    cached_tokens: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """Newly committed tokens; ``finish_reason`` is ``"stop"``, ``"length"`` or None."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    # One per token when the request asked for log-probabilities (mesh.frames).
    logprobs: tuple[Any, ...] = ()
    # With ``score_prompt``, on the first event only: one ``mesh.frames.TokenLogprob``
    # per prompt token after the first (entry i scores prompt token i + 1 given the
    # tokens before it) under the model's own distribution (no penalties, biases or
    # temperature), with ``sampling.top_logprobs`` alternatives.
    prompt_logprobs: tuple[Any, ...] = ()
    # With ``pooling``, on the first event only: the prompt's rows of the final-normed
    # hidden state, pooled (their mean, or the last row), not normalised.
    embedding: tuple[float, ...] = ()


@runtime_checkable
class GenerationBackend(Protocol):
    """What stage 0's engine offers the HTTP layer."""

    model_id: str
    context_length: int

    def ready(self) -> bool:
        """True once the whole pipeline is loaded and can serve."""
        ...

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot serve now (shown by /health and 503s), or None."""
        ...

    async def wait_ready(self) -> bool:
        """Whether the backend can serve, after waiting a bounded time for a pipeline
        that is being reloaded (a stage lost, a new plan); a backend that has never
        served answers at once."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Start generating; see the module docstring for the full contract."""
        ...
