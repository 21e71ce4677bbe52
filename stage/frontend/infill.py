"""``POST /infill``: llama.cpp's code-completion endpoint, for editor plugins written
against llama-server (llama.vscode, llama.vim and others).

The body takes the text before and after the cursor (``input_prefix``,
``input_suffix``), files for context (``input_extra``: ``[{"filename", "text"}]``)
and the start of the middle the editor already has (``prompt``), with llama.cpp's
sampling names (``n_predict``, ``repeat_penalty``) beside this server's usual
parameters. It runs as one completion of the fill-in-the-middle prompt
(stage/frontend/fim.py); a prompt longer than the context is cut as llama.cpp cuts
it (context files first, then the prefix's start and the suffix's end) and the
answer says ``truncated``. The answer has llama.cpp's shape: ``content``, ``stop``,
``stop_type``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
``timings``; streamed, one ``data: {"content": ..., "stop": false}`` event per piece
and a last one with ``stop: true`` and the totals.

Two of llama.cpp's limits on the middle are kept: ``n_indent`` (the middle ends
before the first line after its first newline that is indented by fewer
characters) and ``t_max_predict_ms`` (once the middle holds a newline, it ends at
the first token after that many milliseconds of generation). Hints with nothing to
do here are accepted and ignored: ``cache_prompt`` (prefixes are always kept),
``samplers`` (the sampling order is fixed), ``t_max_prompt_ms``,
``response_fields`` (every field is sent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, Strict, model_validator

from mesh.errors import MeshError
from stage.frontend.errors import bad_request, from_mesh_error
from stage.frontend.fim import encode_text, extra_tokens, fim_prompt, fit_to_room
from stage.frontend.generation import GenerationRun
from stage.frontend.prepare import (
    PreparedGeneration,
    PromptContext,
    check_common,
    fim_of,
    prepared_generation,
)
from stage.frontend.schemas import MAX_TOKENS_MAX, GenerationBody
from stage.frontend.schemas_base import Str, _Body
from stage.frontend.streaming import ClientDisconnected, EventStreamResponse, sse, until_disconnect
from stage.frontend.telemetry import CLIENT_CLOSED_STATUS

logger = logging.getLogger(__name__)

INFILL_PATH = "/infill"
# Tokens kept free for the middle when the request sets no n_predict (at most a
# quarter of the context).
DEFAULT_MIDDLE_ROOM = 256
MAX_EXTRA_FILES = 256


class InputFile(_Body):
    filename: Str = ""
    text: Str = ""


class InfillBody(GenerationBody):
    """``/infill``'s body: llama.cpp's fields and this server's generation ones."""

    input_prefix: Str = ""
    input_suffix: Str = ""
    input_extra: Annotated[list[InputFile], Field(max_length=MAX_EXTRA_FILES)] = []
    # The start of the middle the client already has (after the middle token).
    prompt: Str = ""
    n_indent: Annotated[int, Strict(), Field(ge=0)] | None = None
    t_max_predict_ms: Annotated[int, Strict(), Field(ge=0)] | None = None
    # llama.cpp's hints, accepted and ignored (see the module's doc).
    cache_prompt: Any = None
    samplers: Any = None
    t_max_prompt_ms: Any = None
    response_fields: Any = None

    @model_validator(mode="before")
    @classmethod
    def _llama_names(cls, data: Any) -> Any:
        """llama.cpp's names for fields this server spells OpenAI's way:
        ``n_predict`` (-1: no limit but the context) and ``repeat_penalty``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for theirs, ours in (("n_predict", "max_tokens"), ("repeat_penalty", "repetition_penalty")):
            if theirs not in data:
                continue
            if ours in data:
                raise bad_request(f"send {theirs} or {ours}, not both", theirs)
            value = data.pop(theirs)
            if theirs == "n_predict" and isinstance(value, int) and not isinstance(value, bool):
                if value < 0:
                    continue
                if value == 0 or value > MAX_TOKENS_MAX:
                    raise bad_request(
                        f"n_predict must be -1 (up to the context) or 1 to {MAX_TOKENS_MAX}, "
                        f"got {value}",
                        "n_predict",
                    )
            data[ours] = value
        return data

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.n not in (None, 1):
            problems.append(("n", "/infill gives one completion; n must be 1"))
        return problems


@dataclass(frozen=True)
class Infill:
    """A prepared ``/infill`` request."""

    prepared: PreparedGeneration
    truncated: bool
    n_indent: int
    t_max_predict_s: float


def _prompt(body: InfillBody, ctx: PromptContext) -> tuple[list[int], bool]:
    fim = fim_of(ctx, "input_prefix")
    tokenizer = ctx.tokenizer
    prefix = encode_text(tokenizer, body.input_prefix)
    suffix = encode_text(tokenizer, body.input_suffix)
    middle = encode_text(tokenizer, body.prompt)
    files = [
        extra_tokens(tokenizer, fim, [(chunk.filename, chunk.text)]) for chunk in body.input_extra
    ]
    fixed = len(fim_prompt(fim, [], [], middle))
    wanted = body.requested_max_tokens or min(DEFAULT_MIDDLE_ROOM, ctx.context_length // 4)
    room = ctx.context_length - fixed - wanted
    prefix, suffix, files, cut = fit_to_room(prefix, suffix, files, room)
    extra = [token for chunk in files for token in chunk]
    return fim_prompt(fim, prefix, suffix, middle, extra), cut


async def prepare_infill(body: InfillBody, ctx: PromptContext) -> Infill:
    stop = check_common(body, ctx)
    prompt, truncated = await asyncio.to_thread(_prompt, body, ctx)
    fim = fim_of(ctx, "input_prefix")
    ctx = replace(ctx, stop_token_ids=ctx.stop_token_ids | fim.ends)
    prepared = prepared_generation("completion", body, [prompt], stop, ctx)
    limit_ms = body.t_max_predict_ms or 0
    return Infill(prepared, truncated, body.n_indent or 0, limit_ms / 1000.0)


class MiddleLimits:
    """``n_indent`` and ``t_max_predict_ms`` on a middle's text as it comes: ``feed``
    returns the text that may go out now; ``ended`` turns true when a limit ended
    the middle (the rest of the generation is not wanted)."""

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


def _final(run: GenerationRun, infill: Infill, content: str, limited: bool) -> dict[str, Any]:
    return {
        "index": 0,
        "content": content,
        "stop": True,
        "model": run.prepared.model_id,
        "tokens_predicted": run.completion_tokens,
        "tokens_evaluated": len(run.request.prompt_tokens),
        "tokens_cached": run.cached_tokens,
        "truncated": infill.truncated,
        "stop_type": _stop_type(run, limited),
        "stopping_word": run.stop_string or "",
        "timings": run.timings(),
    }


async def _pieces(run: GenerationRun, limits: MiddleLimits) -> AsyncIterator[str]:
    """The middle's text as it may go out, ending where a limit ends it."""
    while (text := await run.next_text()) is not None:
        out = limits.feed(text, time.perf_counter())
        if out:
            yield out
        if limits.ended:
            return
    if rest := limits.flush():
        yield rest


async def _events(run: GenerationRun, infill: Infill, limits: MiddleLimits) -> AsyncIterator[bytes]:
    parts: list[str] = []
    try:
        async for piece in _pieces(run, limits):
            parts.append(piece)
            yield sse({"index": 0, "content": piece, "stop": False})
    except MeshError as exc:
        logger.warning("request %s failed mid-stream: %s", run.request.request_id, exc)
        yield sse(from_mesh_error(exc, 1).body())
        return
    yield sse(_final(run, infill, "", limits.ended))


async def serve_infill(request: Request, run: GenerationRun, infill: Infill) -> Response:
    """Run the fill and answer in llama.cpp's shape (streamed when asked)."""
    handed_over = False
    try:
        await until_disconnect(request.receive, run.start())
        limits = MiddleLimits(infill.n_indent, infill.t_max_predict_s, time.perf_counter())
        if infill.prepared.stream:
            handed_over = True
            return EventStreamResponse(_events(run, infill, limits), on_close=run.aclose)

        async def collect() -> str:
            return "".join([piece async for piece in _pieces(run, limits)])

        content = await until_disconnect(request.receive, collect())
        return JSONResponse(_final(run, infill, content, limits.ended))
    except ClientDisconnected:
        logger.info("client left before request %s finished", run.request.request_id)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        if not handed_over:
            await run.aclose()
