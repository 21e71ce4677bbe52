"""OpenAI response bodies, server-sent events, and client-disconnect handling.

``EventStreamResponse`` streams SSE chunks while watching the connection: when the
client goes away it cancels the stream at once (not at the next token), and in
every case it calls ``on_close``, which stops the generation in the backend.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mesh.errors import MeshError
from stage.frontend.errors import OpenAIError, from_mesh_error
from stage.frontend.generation import GenerationRun
from stage.frontend.reasoning import split_reasoning, splitter_for
from stage.frontend.telemetry import FrontendMetrics
from stage.frontend.token_bytes import token_bytes

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away.

    Call only after the request body has been read in full.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ClientDisconnected. ``work`` may be a coroutine or any future, ``asyncio.gather``'s
    too: a cancelled gather ends with a CancelledError *result*, not cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        left = not task.done()
        if left:
            task.cancel()
        await asyncio.wait({task, watcher})
    if left:
        if not task.cancelled():
            task.exception()  # retrieved: asyncio would log it as never retrieved
        raise ClientDisconnected()
    return task.result()


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {_dumps(payload)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _token_text(tokenizer: Any, token: int) -> str:
    """A token's text as log-probabilities show it: its own bytes as UTF-8 (U+FFFD
    where it holds part of a character), so a SentencePiece token keeps the leading
    space its decoding alone strips, and the tokens of an answer join into it."""
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


def chat_logprobs(run: GenerationRun, entries: list[tuple[int, Any]]) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` of ``entries`` (None when not asked for)."""
    if run.request.sampling.top_logprobs < 0:
        return None

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(run.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(run.tokenizer, token))}

    return {
        "content": [
            {**item(token, entry.logprob), "top_logprobs": [item(t, v) for t, v in entry.top]}
            for token, entry in entries
        ]
    }


def llama_probabilities(
    run: GenerationRun, entries: list[tuple[int, Any]]
) -> list[dict[str, Any]] | None:
    """llama.cpp's ``completion_probabilities`` of ``entries``: per token its ``id``,
    ``token``, ``bytes``, ``logprob`` and ``top_logprobs`` (the same fields per
    alternative); None when ``n_probs`` did not ask for them."""
    if run.request.sampling.top_logprobs < 0:
        return None

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(run.tokenizer, token)
        raw = list(token_bytes(run.tokenizer, token))
        return {"id": token, "token": text, "bytes": raw, "logprob": logprob}

    return [
        {**item(token, entry.logprob), "top_logprobs": [item(t, v) for t, v in entry.top]}
        for token, entry in entries
    ]


class TextOffsets:
    """Legacy ``text_offset``s of a completion's tokens: each token's offset is the
    count of whole characters its earlier tokens' bytes decode to, from ``start``
    (the echoed prompt's length, or 0). A character split over several tokens is
    counted once, when its last byte comes, so the offsets point into the text
    returned (a token's own text, U+FFFD for a part of a character, would count one
    per part); kept across a stream's chunks, so streamed offsets equal the
    unstreamed ones however the tokens are grouped."""

    def __init__(self, start: int) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, pieces: list[bytes]) -> list[int]:
        """The offsets of the next tokens, whose bytes are ``pieces``."""
        offsets = []
        for piece in pieces:
            offsets.append(self.chars)
            self.chars += len(self._decoder.decode(piece))
        return offsets


def completion_logprobs(
    run: GenerationRun, entries: list[tuple[int, Any]], offsets: TextOffsets
) -> dict[str, Any] | None:
    """OpenAI's legacy completions ``logprobs`` of ``entries``, the next tokens of
    ``offsets`` (None when not asked for)."""
    if run.request.sampling.top_logprobs < 0:
        return None
    tokens = [_token_text(run.tokenizer, token) for token, _ in entries]
    pieces = [bytes(token_bytes(run.tokenizer, token)) for token, _ in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for _, entry in entries],
        "top_logprobs": [_legacy_top(run, token, entry) for token, entry in entries],
        "text_offset": offsets.take(pieces),
    }


def _legacy_top(run: GenerationRun, token: int, entry: Any) -> dict[str, float]:
    """One position's legacy ``top_logprobs``: the alternatives by text, and always
    the chosen token (as OpenAI's: up to ``logprobs`` + 1 entries). Where tokens share
    a text (parts of characters all read U+FFFD), the chosen token's value is the
    one kept: ``top_logprobs[i][tokens[i]]`` is ``token_logprobs[i]``."""
    top = {_token_text(run.tokenizer, t): v for t, v in entry.top}
    top[_token_text(run.tokenizer, token)] = entry.logprob
    return top


def prompt_logprobs(run: GenerationRun) -> dict[str, Any] | None:
    """The legacy ``logprobs`` of an echoed, scored prompt, offsets from 0: its first
    token has none (nothing comes before it), hence ``null`` (None when not scored)."""
    if not run.request.score_prompt or run.request.sampling.top_logprobs < 0:
        return None
    tokens = [_token_text(run.tokenizer, token) for token in run.request.prompt_tokens]
    entries = run.prompt_logprobs
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [entry.logprob for entry in entries],
        "top_logprobs": [None]
        + [
            _legacy_top(run, token, entry)
            for token, entry in zip(run.request.prompt_tokens[1:], entries, strict=False)
        ],
        "text_offset": _prompt_offsets(run),
    }


def _prompt_offsets(run: GenerationRun) -> list[int]:
    """Each prompt token's character offset in the echoed text. Where the tokenizer
    maps the echoed text back to the same tokens with offsets (a fast tokenizer and a
    string prompt), those: a token the tokenizer adds (a BOS token) is at 0 and takes
    no room, so the text's own tokens keep their places in it. Otherwise the tokens'
    texts laid end to end."""
    if getattr(run.tokenizer, "is_fast", False):  # only fast tokenizers give offsets
        encoded = run.tokenizer(run.echo, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == list(run.request.prompt_tokens):
            return [int(start) for start, _ in encoded["offset_mapping"]]
    pieces = [bytes(token_bytes(run.tokenizer, token)) for token in run.request.prompt_tokens]
    return TextOffsets(0).take(pieces)


def _echoed_logprobs(run: GenerationRun) -> dict[str, Any] | None:
    """A completion choice's ``logprobs``: the scored prompt's, then the completion's."""
    generated = completion_logprobs(run, run.logprobs, TextOffsets(len(run.echo)))
    prompt = prompt_logprobs(run)
    if prompt is None or generated is None:
        return generated
    return {key: prompt[key] + generated[key] for key in prompt}


def _final_choice(run: GenerationRun, text: str) -> dict[str, Any]:
    """One choice of a non-streaming answer."""
    p = run.prepared
    if p.kind != "chat":
        return {
            "index": run.index,
            "text": run.echo + text,
            "logprobs": _echoed_logprobs(run),
            "finish_reason": run.finish_reason,
        }
    thought = None
    if p.reasoning is not None:
        thought, text = split_reasoning(text, p.reasoning)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = run.finish_reason
    if p.tools is not None:
        content, calls = p.tools.split(p.tools.prefix + text)
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            # Cut by the token budget stays "length": the answer did not end itself.
            finish = "length" if finish == "length" else "tool_calls"
    if p.reasoning is not None:
        message["reasoning_content"] = thought
    return {
        "index": run.index,
        "message": message,
        "logprobs": chat_logprobs(run, run.logprobs),
        "finish_reason": finish,
    }


def usage_of(runs: list[GenerationRun]) -> dict[str, Any]:
    """``usage`` of a request's choices: each prompt once (counted on its first
    choice), every choice's tokens."""
    usage = runs[0].usage()
    firsts = [run for run in runs if run.index % run.prepared.choices == 0]
    prompt = sum(len(run.request.prompt_tokens) for run in firsts)
    completion = sum(run.completion_tokens for run in runs)
    usage["prompt_tokens"] = prompt
    usage["completion_tokens"] = completion
    usage["total_tokens"] = prompt + completion
    usage["prompt_tokens_details"] = {"cached_tokens": sum(run.cached_tokens for run in firsts)}
    if "completion_tokens_details" in usage:
        details = [run.usage()["completion_tokens_details"] for run in runs]
        usage["completion_tokens_details"] = {
            key: sum(d[key] for d in details) for key in details[0]
        }
    return usage


def final_body(runs: list[GenerationRun], texts: list[str]) -> dict[str, Any]:
    """The non-streaming answer of a request whose choices (``runs``) finished."""
    p = runs[0].prepared
    body: dict[str, Any] = {
        "id": p.response_id,
        "object": "chat.completion" if p.kind == "chat" else "text_completion",
        "created": p.created,
        "model": p.model_id,
        "choices": [_final_choice(run, text) for run, text in zip(runs, texts, strict=True)],
        "usage": usage_of(runs),
        "timings": runs[0].timings(),
    }
    if p.fingerprint:
        body["system_fingerprint"] = p.fingerprint
    return body


def _chunk(run: GenerationRun, choices: list[dict[str, Any]]) -> dict[str, Any]:
    p = run.prepared
    chunk: dict[str, Any] = {
        "id": p.response_id,
        "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
        "created": p.created,
        "model": p.model_id,
        "choices": choices,
    }
    if p.fingerprint:
        chunk["system_fingerprint"] = p.fingerprint
    if p.continuous_usage and choices:
        usage = run.usage()
        chunk["usage"] = {key: usage[key] for key in _RUNNING_USAGE}
    elif p.include_usage:
        chunk["usage"] = None
    return chunk


# The counts a chunk carries with ``continuous_usage_stats``.
_RUNNING_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def _choice(
    run: GenerationRun,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    common = {"index": run.index, "logprobs": logprobs, "finish_reason": finish_reason}
    if run.prepared.kind == "chat":
        return {"delta": {} if text is None else {"content": text}, **common}
    return {"text": text or "", **common}


def _chunk_logprobs(run: GenerationRun, offsets: TextOffsets) -> dict[str, Any] | None:
    """The log-probabilities of the tokens not streamed yet (``offsets``: the
    completion's text offsets so far)."""
    entries = run.take_logprobs()
    if not entries:
        return None
    if run.prepared.kind == "chat":
        return chat_logprobs(run, entries)
    return completion_logprobs(run, entries, offsets)


async def sse_events(
    runs: list[GenerationRun], metrics: FrontendMetrics, retry_after_s: int
) -> AsyncIterator[bytes]:
    """The SSE byte chunks of a request's started choices (``runs``), ending with
    ``data: [DONE]``; several choices' chunks interleave as their tokens come."""
    if len(runs) == 1:
        chunks = _choice_events(runs[0], metrics, retry_after_s)
    else:
        chunks = _merged(runs, metrics, retry_after_s)
    failed = False
    async for chunk, error in chunks:
        failed = failed or error
        yield chunk
    if failed and len(runs) == 1:
        return
    run = runs[0]
    if run.prepared.include_usage:
        usage = _chunk(run, [])
        usage["usage"] = usage_of(runs)
        usage["timings"] = run.timings()
        yield sse(usage)
    yield SSE_DONE


async def _merged(
    runs: list[GenerationRun], metrics: FrontendMetrics, retry_after_s: int
) -> AsyncIterator[tuple[bytes, bool]]:
    """Every choice's chunks, in the order they are ready."""
    queue: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()

    async def pump(run: GenerationRun) -> None:
        try:
            async for item in _choice_events(run, metrics, retry_after_s):
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _choice_events(
    run: GenerationRun, metrics: FrontendMetrics, retry_after_s: int
) -> AsyncIterator[tuple[bytes, bool]]:
    """One choice's SSE chunks, each with whether it reports an error (the choice's
    last chunk then)."""
    chat = run.prepared.kind == "chat"
    tools = run.prepared.tools if chat else None
    if chat:
        # With tools the answer may be calls alone: its content starts as null (as
        # OpenAI's does for calls), so that a client's accumulated message does not
        # read "" where the same answer unstreamed reads null.
        opening = {"role": "assistant", "content": "" if tools is None else None}
        first = {"index": run.index, "delta": opening}
        yield sse(_chunk(run, [{**first, "logprobs": None, "finish_reason": None}])), False
    # With tools, text from (what may become) a tool call on is held back and sent
    # as tool-call deltas once the answer is complete.
    answer = tools.prefix if tools is not None else ""
    released = 0
    # A reasoning model's thought goes out as ``reasoning_content`` deltas.
    thinking = run.prepared.reasoning if chat else None
    splitter = splitter_for(thinking) if thinking is not None else None
    if run.prepared.echo:  # the prompt's text (and scores) before the completion's
        yield sse(_chunk(run, [_choice(run, run.echo, None, prompt_logprobs(run))])), False
    offsets = TextOffsets(len(run.echo) if run.prepared.echo else 0)
    try:
        ended = False
        while not ended:
            text = await run.next_text()
            thought = ""
            if splitter is not None:
                ended = text is None
                thought, text = splitter.flush() if ended else splitter.feed(text or "")
            elif text is None:
                break
            if thought:
                delta = {"reasoning_content": thought}
                choice = {"index": run.index, "delta": delta, "finish_reason": None}
                yield (
                    sse(_chunk(run, [{**choice, "logprobs": _chunk_logprobs(run, offsets)}])),
                    False,
                )
            if tools is not None and text:
                answer += text
                cut = max(released, tools.hold_start(answer))
                text, released = answer[released:cut], cut
            if text:
                choice = _choice(run, text, None, _chunk_logprobs(run, offsets))
                yield sse(_chunk(run, [choice])), False
    except MeshError as exc:
        logger.warning("request %s failed mid-stream: %s", run.request.request_id, exc)
        if exc.http_status == 500:
            metrics.internal_errors.inc()
        yield sse(from_mesh_error(exc, retry_after_s).body()), True
        return
    except Exception:
        metrics.internal_errors.inc()
        logger.exception("request %s failed mid-stream", run.request.request_id)
        error = OpenAIError(500, "internal server error; the server logged the details")
        yield sse(error.body()), True
        return
    finish = run.finish_reason
    held = answer[released:]
    if tools is not None and held:
        content, calls = tools.split(held)
        if content:
            yield sse(_chunk(run, [_choice(run, content, None)])), False
        if calls:
            for index, call in enumerate(calls):
                delta = {"tool_calls": [call.to_openai(index)]}
                choice = {"index": run.index, "delta": delta, "logprobs": None}
                yield sse(_chunk(run, [{**choice, "finish_reason": None}])), False
            finish = "length" if finish == "length" else "tool_calls"
    last = _chunk(run, [_choice(run, None, finish, _chunk_logprobs(run, offsets))])
    last["timings"] = run.timings()
    yield sse(last), False


class EventStreamResponse(Response):
    """A text/event-stream response that stops its producer when the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        # No body attribute: init_headers then declares no Content-Length (chunked).
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )
        self._events = events
        self._on_close = on_close

    async def _stream(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # ASGI servers of spec 2.4 report a closed connection by failing the send.
            logger.info("client closed the event stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not streamer.done():
                streamer.cancel()
            await asyncio.wait({streamer, watcher})
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            await self._on_close()
        if not streamer.cancelled() and streamer.exception() is not None:
            raise streamer.exception()  # type: ignore[misc]
