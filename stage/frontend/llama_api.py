"""llama.cpp's own routes, for clients written against llama-server: ``POST
/completion`` (its native completion), ``POST /infill`` (infill.py), ``GET /props``
and ``POST /apply-template``.

Bodies take llama.cpp's names beside this server's usual parameters
(``LlamaBody``): ``n_predict`` (-1 or -2: up to the context), ``repeat_penalty``,
``penalty_last_n`` (``repeat_last_n``), ``seed: -1`` (a random seed), ``n_probs``
(``completion_probabilities`` in the answer and in each streamed event); its samplers
DRY, XTC, ``typical_p``, ``top_n_sigma`` and dynamic temperature are this server's
too (mesh/sampling.py). llama.cpp clients send their whole sampler set, mostly at
values that turn a sampler off; a field of a sampler not built here (mirostat,
``tfs_z``, ...) is accepted when its value asks for nothing (``NEUTRAL``) and
refused with a 400 that names it otherwise. Hints with nothing to do here are accepted and ignored
(``HINTS``): ``cache_prompt`` (prefixes are always kept), ``samplers`` (the order
is fixed), ``t_max_prompt_ms``, ``response_fields`` (every field is sent),
``id_slot``. Two limits on the text are kept (``TextLimits``): ``n_indent`` and
``t_max_predict_ms``.

Answers have llama.cpp's shape: ``content``, ``stop``, ``stop_type`` (``eos``,
``word``, ``limit``), ``stopping_word``, ``tokens_predicted``,
``tokens_evaluated``, ``tokens_cached``, ``truncated``, ``model``, ``timings``;
streamed, one ``data: {"content": ..., "stop": false}`` event per piece and a last
one with ``stop: true`` and the totals. Errors are OpenAI error bodies, as on every
route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, Strict, model_validator

from mesh.errors import MeshError
from mesh.types import TOP_LOGPROBS_MAX
from stage.frontend import dry
from stage.frontend.errors import bad_request, from_mesh_error
from stage.frontend.generation import GenerationRun
from stage.frontend.model_defaults import SamplingDefaults
from stage.frontend.prepare import (
    PreparedGeneration,
    PromptContext,
    check_common,
    check_text_fits,
    encode_prompt,
    prepared_generation,
)
from stage.frontend.schemas import (
    DRY_DEFAULT_BREAKERS,
    MAX_TOKENS_MAX,
    GenerationBody,
    TokenList,
)
from stage.frontend.schemas_base import Str
from stage.frontend.streaming import llama_probabilities, sse
from stage.frontend.translated import serve_run

logger = logging.getLogger(__name__)

COMPLETION_PATH = "/completion"
PROPS_PATH = "/props"
APPLY_TEMPLATE_PATH = "/apply-template"

# Accepted and ignored: nothing to do here (see the module's doc).
HINTS = ("cache_prompt", "samplers", "t_max_prompt_ms", "response_fields", "id_slot")
_OFF = object()


def _penalties_off(body: dict[str, Any]) -> bool:
    return (
        body.get("repeat_penalty", body.get("repetition_penalty", 1.0)) == 1.0
        and not body.get("presence_penalty")
        and not body.get("frequency_penalty")
    )


# llama.cpp's samplers not built here: field -> whether the body's value asks for
# nothing (the sampler is off, or the field only tunes an off sampler).
NEUTRAL: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "tfs_z": lambda v, b: v == 1,
    "mirostat": lambda v, b: v == 0,
    "mirostat_tau": lambda v, b: not b.get("mirostat"),
    "mirostat_eta": lambda v, b: not b.get("mirostat"),
    # The penalties here count newlines as any token.
    "penalize_nl": lambda v, b: v is True or _penalties_off(b),
    "n_keep": lambda v, b: True,  # what to keep when the context overflows: it never does
    "min_keep": lambda v, b: v in (0, 1),
    "post_sampling_probs": lambda v, b: not v,
    "return_tokens": lambda v, b: not v,
}


class LlamaBody(GenerationBody):
    """A llama.cpp-shaped generation body (see the module's doc)."""

    n_indent: Annotated[int, Strict(), Field(ge=0)] | None = None
    t_max_predict_ms: Annotated[int, Strict(), Field(ge=0)] | None = None
    # Each token's log-probability with this many alternatives (llama.cpp's
    # ``completion_probabilities``); 0: none.
    n_probs: Annotated[int, Strict(), Field(ge=0, le=TOP_LOGPROBS_MAX)] | None = None

    @property
    def requested_top_logprobs(self) -> int:
        return self.n_probs if self.n_probs else -1

    @model_validator(mode="before")
    @classmethod
    def _llama_names(cls, data: Any) -> Any:
        """llama.cpp's names and values into this server's; its samplers' off
        values and its hints dropped, any other value of them refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in HINTS:
            data.pop(name, None)
        for name, neutral in NEUTRAL.items():
            if name in data and not neutral(data[name], data):
                raise bad_request(
                    f"{name}={data[name]!r}: this server does not have that llama.cpp "
                    "sampler; leave it out or at the value that turns it off",
                    name,
                    code="unsupported_parameter",
                )
        for name in NEUTRAL:
            data.pop(name, None)
        if data.get("seed") == -1:
            data.pop("seed")  # llama.cpp's "a random seed"
        renamed = (
            ("n_predict", "max_tokens"),
            ("repeat_penalty", "repetition_penalty"),
            ("penalty_last_n", "repeat_last_n"),
        )
        for theirs, ours in renamed:
            if theirs not in data:
                continue
            if ours in data:
                raise bad_request(f"send {theirs} or {ours}, not both", theirs)
            value = data.pop(theirs)
            if theirs == "n_predict" and isinstance(value, int) and not isinstance(value, bool):
                if value in (-1, -2):
                    continue  # llama.cpp's "no limit" and "until the context is full"
                if value < -2 or value == 0 or value > MAX_TOKENS_MAX:
                    raise bad_request(
                        f"n_predict must be -1 or -2 (up to the context) or 1 to "
                        f"{MAX_TOKENS_MAX}, got {value}",
                        "n_predict",
                    )
            data[ours] = value
        return data

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.n not in (None, 1):
            problems.append(("n", "llama.cpp's routes give one completion; n must be 1"))
        return problems


class NativeCompletionBody(LlamaBody):
    """``POST /completion``: ``prompt`` is text or token ids."""

    prompt: Str | TokenList


async def prepare_native(body: NativeCompletionBody, ctx: PromptContext) -> LlamaRequest:
    """``POST /completion``: a completion of ``prompt``."""
    stop = check_common(body, ctx)
    if isinstance(body.prompt, str):
        check_text_fits(len(body.prompt), ctx, "prompt")
    await dry.warm(body, ctx.tokenizer)
    prompt = await asyncio.to_thread(encode_prompt, ctx.tokenizer, body.prompt)
    return LlamaRequest.of(prepared_generation("completion", body, [prompt], stop, ctx), body)


@dataclass(frozen=True)
class LlamaRequest:
    """A prepared request of a llama.cpp route."""

    prepared: PreparedGeneration
    n_indent: int = 0
    t_max_predict_s: float = 0.0
    truncated: bool = False

    @classmethod
    def of(
        cls, prepared: PreparedGeneration, body: LlamaBody, truncated: bool = False
    ) -> LlamaRequest:
        limit_ms = body.t_max_predict_ms or 0
        return cls(prepared, body.n_indent or 0, limit_ms / 1000.0, truncated)


class TextLimits:
    """``n_indent`` and ``t_max_predict_ms`` on a text as it comes: ``feed`` returns
    what may go out now; ``ended`` turns true when a limit ended the text (the rest
    of the generation is not wanted).

    ``n_indent: N`` ends the text before the first line after its first newline
    that is indented by fewer than N characters (blank lines pass);
    ``t_max_predict_ms`` ends it after the first piece that comes that long after
    the start once the text holds a newline."""

    def __init__(self, n_indent: int, t_max_predict_s: float, start_s: float) -> None:
        self.n_indent = n_indent
        self.deadline_s = start_s + t_max_predict_s if t_max_predict_s > 0 else None
        self.newline = False
        # At the start of a line after a newline, before its first non-blank
        # character: its indentation is held back until it is known.
        self.checking = False
        self.held = ""
        self.ended = False

    def feed(self, piece: str, now_s: float) -> str:
        out = []
        for char in piece:
            if self.ended:
                break
            out.append(self._char(char))
        if self.newline and self.deadline_s is not None and now_s >= self.deadline_s:
            self.ended = True
        return "".join(out)

    def _char(self, char: str) -> str:
        if self.checking:
            if char in " \t":
                self.held += char
                return ""
            out, self.held = self.held + char, ""
            if char == "\n":  # a blank line: the next one is checked
                return out
            if len(out) - 1 < self.n_indent:
                self.ended = True
                return ""
            self.checking = False
            return out
        if char == "\n":
            self.newline = True
            self.checking = self.n_indent > 0
        return char

    def flush(self) -> str:
        """Text held back when the generation ended on its own."""
        held, self.held = self.held, ""
        return "" if self.ended else held


def _stop_type(run: GenerationRun, limited: bool) -> str:
    if limited or run.finish_reason == "length":
        return "limit"
    return "word" if run.stop_string is not None else "eos"


def _final(
    run: GenerationRun, ask: LlamaRequest, content: str, limited: bool, streamed: bool = False
) -> dict[str, Any]:
    """The answer (or the stream's last event, whose probabilities are those not sent
    yet)."""
    entries = run.take_logprobs() if streamed else list(run.logprobs)
    probabilities = llama_probabilities(run, entries)
    extra = {} if probabilities is None else {"completion_probabilities": probabilities}
    return {
        "index": 0,
        "content": content,
        **extra,
        "stop": True,
        "model": run.prepared.model_id,
        "tokens_predicted": run.completion_tokens,
        "tokens_evaluated": len(run.request.prompt_tokens),
        "tokens_cached": run.cached_tokens,
        "truncated": ask.truncated,
        "stop_type": _stop_type(run, limited),
        "stopping_word": run.stop_string or "",
        "timings": run.timings(),
    }


async def _pieces(run: GenerationRun, limits: TextLimits) -> AsyncIterator[str]:
    """The text as it may go out, ending where a limit ends it."""
    while (text := await run.next_text()) is not None:
        out = limits.feed(text, time.perf_counter())
        if out:
            yield out
        if limits.ended:
            return
    if rest := limits.flush():
        yield rest


class LlamaShape:
    """A run's answer in llama.cpp's shape (stage/frontend/translated.py's
    ``serve_run``), its text held to the request's limits (``TextLimits``)."""

    def __init__(self, ask: LlamaRequest) -> None:
        self.ask = ask
        self.limits = TextLimits(0, 0.0, 0.0)

    def texts(self, run: GenerationRun) -> AsyncIterator[str]:
        """The text as it may go out; the limits' clock starts now (the run started)."""
        ask = self.ask
        self.limits = TextLimits(ask.n_indent, ask.t_max_predict_s, time.perf_counter())
        return _pieces(run, self.limits)

    def body(self, run: GenerationRun, text: str) -> dict[str, Any]:
        return _final(run, self.ask, text, self.limits.ended)

    async def events(self, run: GenerationRun, texts: AsyncIterator[str]) -> AsyncIterator[bytes]:
        try:
            async for piece in texts:
                event: dict[str, Any] = {"index": 0, "content": piece, "stop": False}
                probabilities = llama_probabilities(run, run.take_logprobs())
                if probabilities is not None:
                    event["completion_probabilities"] = probabilities
                yield sse(event)
        except MeshError as exc:
            logger.warning("request %s failed mid-stream: %s", run.request.request_id, exc)
            yield sse(from_mesh_error(exc, 1).body())
            return
        yield sse(_final(run, self.ask, "", self.limits.ended, streamed=True))


async def serve_llama(request: Request, run: GenerationRun, ask: LlamaRequest) -> Response:
    """Run the generation and answer in llama.cpp's shape (streamed when asked)."""
    shape = LlamaShape(ask)
    return await serve_run(request, run, shape, shape.texts)


def props(
    model_id: str,
    tokenizer: Any,
    context_length: int,
    slots: int | None,
    version: str,
    defaults: SamplingDefaults = SamplingDefaults(),
) -> dict[str, Any]:
    """``GET /props``: what llama.cpp clients read of the server; ``defaults`` what
    a request's unset sampling parameters become."""

    def token_text(name: str) -> str:
        return str(getattr(tokenizer, name, None) or "")

    return {
        "default_generation_settings": {
            "n_ctx": context_length,
            "params": {
                "n_predict": -1,
                "temperature": defaults.temperature,
                "top_k": defaults.top_k,
                "top_p": defaults.top_p,
                "min_p": defaults.min_p,
                "repeat_penalty": defaults.repetition_penalty,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "repeat_last_n": -1,
                "typical_p": 1.0,
                "top_n_sigma": -1.0,
                "xtc_probability": 0.0,
                "xtc_threshold": 0.1,
                "dry_multiplier": 0.0,
                "dry_base": 1.75,
                "dry_allowed_length": 2,
                "dry_penalty_last_n": -1,
                "dry_sequence_breakers": list(DRY_DEFAULT_BREAKERS),
                "dynatemp_range": 0.0,
                "dynatemp_exponent": 1.0,
                "seed": -1,
            },
        },
        "total_slots": slots if slots is not None else 1,
        "model_path": model_id,
        "chat_template": str(getattr(tokenizer, "chat_template", None) or ""),
        "bos_token": token_text("bos_token"),
        "eos_token": token_text("eos_token"),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"mesh {version}",
    }
