"""Answering another API's request from one chat generation.

Anthropic's Messages API (anthropic.py) and OpenAI's Responses API (responses.py)
are each translated into a chat completion body and run as one choice of
``/v1/chat/completions``; an ``AnswerShape`` then writes the run's answer in the
other API's shape: a JSON body, or that API's server-sent events. ``serve_run``
owns the run's life: the client leaving cancels the generation, whether it waits
for the whole answer or reads a stream, and the run is always closed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from stage.frontend.generation import GenerationRun
from stage.frontend.streaming import ClientDisconnected, EventStreamResponse, until_disconnect
from stage.frontend.telemetry import CLIENT_CLOSED_STATUS

logger = logging.getLogger(__name__)


class AnswerShape(Protocol):
    """How one API writes the answer of a started run."""

    def body(self, run: GenerationRun, text: str) -> dict[str, Any]:
        """The JSON answer of a finished run whose completion text is ``text``."""
        ...

    def events(self, run: GenerationRun, texts: AsyncIterator[str]) -> AsyncIterator[bytes]:
        """The SSE byte chunks of a run whose text pieces come from ``texts``."""
        ...


async def collect_text(run: GenerationRun) -> str:
    """The whole completion text of a started run."""
    parts: list[str] = []
    while (text := await run.next_text()) is not None:
        parts.append(text)
    return "".join(parts)


async def texts_of(run: GenerationRun) -> AsyncIterator[str]:
    """The completion text of a started run, piece by piece."""
    while (text := await run.next_text()) is not None:
        yield text


async def _joined(texts: AsyncIterator[str]) -> str:
    return "".join([text async for text in texts])


async def serve_run(
    request: Request,
    run: GenerationRun,
    shape: AnswerShape,
    texts: Callable[[GenerationRun], AsyncIterator[str]] = texts_of,
) -> Response:
    """Start ``run`` and answer in ``shape``: streamed when the request asked for it.
    ``texts`` gives the answer's text from the started run (by default all of it, as
    it comes).

    Errors before the first token (429, 503, 400 from the backend) are raised, for
    the route to answer in its API's error shape; a client that leaves gets 499.
    """
    handed_over = False
    try:
        await until_disconnect(request.receive, run.start())
        source = texts(run)
        if run.prepared.stream:
            events = shape.events(run, source)
            handed_over = True
            return EventStreamResponse(events, on_close=run.aclose)
        text = await until_disconnect(request.receive, _joined(source))
        return JSONResponse(shape.body(run, text))
    except ClientDisconnected:
        logger.info("client left before request %s finished", run.request.request_id)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        if not handed_over:
            await run.aclose()
