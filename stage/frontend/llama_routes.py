"""llama.cpp's routes on the frontend's app (llama_api.py, infill.py):
``POST /completion``, ``POST /infill``, ``POST /apply-template``, ``GET /props``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mesh import __version__
from stage.frontend.errors import from_validation_error
from stage.frontend.generation import GenerationRun
from stage.frontend.infill import INFILL_PATH, InfillBody, prepare_infill
from stage.frontend.llama_api import (
    APPLY_TEMPLATE_PATH,
    COMPLETION_PATH,
    PROPS_PATH,
    NativeCompletionBody,
    prepare_native,
    props,
    serve_llama,
)
from stage.frontend.prepare import chat_prompt_tokens
from stage.frontend.schemas import ChatCompletionBody
from stage.frontend.telemetry import CLIENT_CLOSED_STATUS

PATHS = (COMPLETION_PATH, INFILL_PATH, APPLY_TEMPLATE_PATH, PROPS_PATH)


async def _generate(front: Any, request: Request, endpoint: str) -> Response:
    """``/completion`` or ``/infill``, answered in llama.cpp's shape."""
    arrival = time.perf_counter()
    payload = await front.payload(request)
    if payload is None:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    model = InfillBody if endpoint == INFILL_PATH else NativeCompletionBody
    try:
        body: Any = model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    await front.check_ready()
    ctx = front.prompt_context(request)
    if endpoint == INFILL_PATH:
        ask = await prepare_infill(body, ctx)
    else:
        ask = await prepare_native(body, ctx)
    prompt_tokens = len(ask.prepared.request.prompt_tokens)
    (release,) = front.claim_slots(ask.prepared.request.tenant, 1, prompt_tokens)
    run = GenerationRun(
        front.backend, ask.prepared, front.tokenizer, front.metrics, endpoint, arrival,
        release=release,
    )  # fmt: skip
    return await serve_llama(request, run, ask)


async def _apply_template(front: Any, request: Request) -> dict[str, Any]:
    """The chat prompt's text, special tokens written out."""
    payload = await front.payload(request)
    if payload is None:
        return {}
    try:
        chat = ChatCompletionBody.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    ids = await asyncio.to_thread(chat_prompt_tokens, chat, front.prompt_context(request))
    text = front.tokenizer.decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return {"prompt": text}


def add_llama_routes(app: FastAPI, front: Any) -> None:
    """Add llama.cpp's routes to ``app``, served by the frontend state ``front``
    (app.py's ``_Frontend``)."""

    @app.post(INFILL_PATH)
    async def infill(request: Request) -> Response:
        return await _generate(front, request, INFILL_PATH)

    @app.post(COMPLETION_PATH)
    async def native_completion(request: Request) -> Response:
        return await _generate(front, request, COMPLETION_PATH)

    @app.post(APPLY_TEMPLATE_PATH)
    async def apply_template(request: Request) -> JSONResponse:
        return JSONResponse(await _apply_template(front, request))

    @app.get(PROPS_PATH)
    async def server_props(request: Request) -> JSONResponse:
        front.authorize(request)
        backend = front.backend
        slots = getattr(backend, "request_capacity", None)
        body = props(
            front.model_id,
            front.tokenizer,
            backend.context_length,
            slots,
            __version__,
            front.limits.sampling_defaults,
        )
        return JSONResponse(body)
