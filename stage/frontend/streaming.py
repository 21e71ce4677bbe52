"""OpenAI response bodies, server-sent events, and client-disconnect handling.

``EventStreamResponse`` streams SSE chunks while watching the connection: when the
client goes away it cancels the stream at once (not at the next token), and in
every case it calls ``on_close``, which stops the generation in the backend.
"""

from __future__ import annotations

import asyncio
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
from stage.frontend.telemetry import FrontendMetrics
from stage.frontend.tools import CALL_OPEN, held_from, parse_tool_calls

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
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait({task, watcher})
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {_dumps(payload)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(run: GenerationRun, entries: list[tuple[int, Any]]) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` of ``entries`` (None when not asked for)."""
    if run.request.sampling.top_logprobs < 0:
        return None

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(run.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(token, entry.logprob), "top_logprobs": [item(t, v) for t, v in entry.top]}
            for token, entry in entries
        ]
    }


def completion_logprobs(
    run: GenerationRun, entries: list[tuple[int, Any]], offset: int = 0
) -> dict[str, Any] | None:
    """OpenAI's legacy completions ``logprobs`` of ``entries``, text offsets from
    ``offset`` (None when not asked for)."""
    if run.request.sampling.top_logprobs < 0:
        return None
    tokens = [_token_text(run.tokenizer, token) for token, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for _, entry in entries],
        "top_logprobs": [
            {_token_text(run.tokenizer, t): v for t, v in entry.top} for _, entry in entries
        ],
        "text_offset": offsets,
    }


def final_body(run: GenerationRun, text: str) -> dict[str, Any]:
    """The non-streaming answer of a finished run."""
    p = run.prepared
    if p.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = run.finish_reason
        if p.tools is not None:
            content, calls = parse_tool_calls(
                p.tools.prefix + text, p.tools.names, p.tools.parallel
            )
            if calls:
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [call.to_openai() for call in calls],
                }
                finish = "tool_calls"
            else:
                message["content"] = p.tools.prefix + text
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(run, run.logprobs),
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(run, run.logprobs),
            "finish_reason": run.finish_reason,
        }
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": p.response_id,
        "object": obj,
        "created": p.created,
        "model": p.model_id,
        "choices": [choice],
        "usage": run.usage(),
        "timings": run.timings(),
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
    if p.include_usage:
        chunk["usage"] = None
    return chunk


def _choice(
    run: GenerationRun,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if run.prepared.kind == "chat":
        delta: dict[str, Any] = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def _chunk_logprobs(run: GenerationRun, sent: int) -> dict[str, Any] | None:
    """The log-probabilities of the tokens not streamed yet (``sent``: characters of
    text streamed before them, for completion offsets)."""
    entries = run.take_logprobs()
    if not entries:
        return None
    if run.prepared.kind == "chat":
        return chat_logprobs(run, entries)
    return completion_logprobs(run, entries, sent)


async def sse_events(
    run: GenerationRun, metrics: FrontendMetrics, retry_after_s: int
) -> AsyncIterator[bytes]:
    """The SSE byte chunks of a started run, ending with ``data: [DONE]``."""
    if run.prepared.kind == "chat":
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        yield sse(_chunk(run, [{**first, "finish_reason": None}]))
    tools = run.prepared.tools if run.prepared.kind == "chat" else None
    # With tools, text from a <tool_call> on is held back and sent as tool-call
    # deltas once the answer is complete.
    held = tools.prefix if tools is not None else ""
    sent = 0
    try:
        while (text := await run.next_text()) is not None:
            if tools is not None and text:
                held += text
                if CALL_OPEN not in held:
                    cut = held_from(held)
                    text, held = held[:cut], held[cut:]
                else:
                    text = ""
            if text:
                yield sse(_chunk(run, [_choice(run, text, None, _chunk_logprobs(run, sent))]))
                sent += len(text)
    except MeshError as exc:
        logger.warning("request %s failed mid-stream: %s", run.request.request_id, exc)
        yield sse(from_mesh_error(exc, retry_after_s).body())
        return
    except Exception:
        metrics.internal_errors.inc()
        logger.exception("request %s failed mid-stream", run.request.request_id)
        yield sse(OpenAIError(500, "internal server error; the server logged the details").body())
        return
    finish = run.finish_reason
    if tools is not None and held:
        content, calls = parse_tool_calls(held, tools.names, tools.parallel)
        if not calls:
            yield sse(_chunk(run, [_choice(run, held, None)]))
        else:
            if content:
                yield sse(_chunk(run, [_choice(run, content, None)]))
            for index, call in enumerate(calls):
                delta = {"tool_calls": [call.to_openai(index)]}
                yield sse(
                    _chunk(
                        run, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
                    )
                )
            finish = "tool_calls"
    last = _chunk(run, [_choice(run, None, finish, _chunk_logprobs(run, sent))])
    last["timings"] = run.timings()
    yield sse(last)
    if run.prepared.include_usage:
        usage = _chunk(run, [])
        usage["usage"] = run.usage()
        usage["timings"] = run.timings()
        yield sse(usage)
    yield SSE_DONE


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
