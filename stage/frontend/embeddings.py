"""``POST /v1/embeddings``: OpenAI's embeddings of the served model.

Each input (a string, token ids, or a list of either) is read through the whole
pipeline as a prompt that generates nothing; the last stage pools its rows of the
model's final-normed hidden state (the mean of every position, or the last
position: ``--embedding-pooling``) and stage 0 answers the vector scaled to length
1, as OpenAI's are: cosine similarity is then a dot product. ``encoding_format``
``base64`` (what the official Python client asks for by default) sends the
little-endian float32 bytes. ``dimensions`` is accepted only when it names the
model's own size: a generative model's hidden state cannot be shortened.

A request's inputs run as separate sessions, at most ``EMBED_WINDOW`` at once (no
more than the sessions free when it arrives, nor than its API key's concurrency),
so a long list of inputs neither fills the engine nor is refused for its length; a
request that finds the server full gets 429, and once admitted, an input that finds
every session taken waits for one (up to ``CAPACITY_WAIT_S``).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict

from mesh.errors import CapacityExceeded, MeshError, Unavailable
from mesh.types import SamplingParams
from stage.frontend.backend import POOLINGS, GenerationBackend, GenerationRequest
from stage.frontend.errors import bad_request
from stage.frontend.prepare import PromptContext, check_text_fits
from stage.frontend.schemas import USER_MAX_CHARS
from stage.frontend.schemas_base import Int, Str, _Body

EMBEDDINGS_PATH = "/v1/embeddings"
# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048
# Inputs of one request read at once (each holds a session on every stage).
EMBED_WINDOW = 4
# How long an input waits for a session that other requests hold (the request was
# admitted: a long list of inputs is not failed half-way for a busy moment).
CAPACITY_WAIT_S = 30.0
CAPACITY_POLL_S = 0.05

TokenIds = Annotated[list[Int], Field(min_length=1)]


class EmbeddingBody(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    input: Str | TokenIds | list[Str] | list[TokenIds]
    # Optional, as on the other routes: a mesh serves one model.
    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Strict(), Field(ge=1)] | None = None
    user: Annotated[str, Strict(), Field(max_length=USER_MAX_CHARS)] | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs: one, or several for a list of strings or of token-id lists."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and isinstance(given[0], int):
            return [list(given)]  # type: ignore[arg-type]
        return list(given)  # type: ignore[arg-type]


def check_body(body: EmbeddingBody, ctx: PromptContext, size: int | None) -> None:
    """400 for what this server cannot do with ``body`` (``size``: the model's
    embedding size where known)."""
    for name in sorted(body.model_extra or {}):
        raise bad_request(
            f"unknown parameter '{name}'; /v1/embeddings takes input, model, "
            "encoding_format, dimensions and user",
            name,
        )
    if body.model is not None and body.model != ctx.model_id:
        raise bad_request(
            f"model {body.model!r} is not served here; this server serves {ctx.model_id!r}",
            "model",
            code="model_not_found",
        )
    count = len(body.inputs())
    if count == 0:
        raise bad_request("input is empty; send a string, a list of strings or token ids", "input")
    if count > MAX_INPUTS:
        raise bad_request(
            f"input holds {count} items; at most {MAX_INPUTS} per request: split it", "input"
        )
    if body.dimensions is not None and size is not None and body.dimensions != size:
        raise bad_request(_dimensions_message(body.dimensions, size), "dimensions")


def _dimensions_message(asked: int, size: int) -> str:
    return (
        f"dimensions={asked}, but this model's embeddings have {size} dimensions and "
        f"cannot be shortened; send dimensions={size} or leave it out"
    )


def input_tokens(body: EmbeddingBody, ctx: PromptContext) -> list[list[int]]:
    """Each input's token ids (text through the model's tokenizer, token ids checked
    against its vocabulary); 400 for an empty input or one longer than the context."""
    items = body.inputs()
    for index, item in enumerate(items):  # before any is tokenized
        if isinstance(item, str):
            name = "input" if len(items) == 1 else f"input {index}"
            check_text_fits(len(item), ctx, "input", name)
    vocab = ctx.vocab()
    encoded: list[list[int]] = []
    for index, item in enumerate(items):
        name = "input" if len(items) == 1 else f"input {index}"
        tokens = (
            [int(t) for t in ctx.tokenizer.encode(item)] if isinstance(item, str) else list(item)
        )
        # Text too: a tokenizer may hold added tokens the model has no rows for.
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"{name} holds token {bad}, outside the vocabulary [0, {vocab})", "input"
            )
        if not tokens:
            raise bad_request(f"{name} is empty after tokenisation; send some text", "input")
        if len(tokens) > ctx.context_length:
            raise bad_request(
                f"{name} has {len(tokens)} tokens but the model's context is "
                f"{ctx.context_length} tokens; shorten it",
                "input",
                code="context_length_exceeded",
            )
        encoded.append(tokens)
    return encoded


def embedding_requests(
    inputs: Sequence[list[int]], pooling: str, tenant: str
) -> list[GenerationRequest]:
    """One request per input: read, pooled, nothing generated."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    base = f"embd-{uuid.uuid4().hex}"
    return [
        GenerationRequest(
            request_id=f"{base}-{index}",
            prompt_tokens=tuple(tokens),
            max_new_tokens=0,
            sampling=SamplingParams(prompt_tokens=len(tokens)),
            stop_token_ids=frozenset(),
            tenant=tenant,
            speculation=False,
            pooling=pooling,
        )
        for index, tokens in enumerate(inputs)
    ]


async def embed_all(
    backend: GenerationBackend, requests: Sequence[GenerationRequest], window: int
) -> list[tuple[float, ...]]:
    """Every request's pooled vector, in order, ``window`` of them in flight at once.
    The first failure cancels the others and is raised."""
    gate = asyncio.Semaphore(max(1, window))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CAPACITY_WAIT_S

    async def one(request: GenerationRequest) -> tuple[float, ...]:
        async with gate:
            while True:
                try:
                    return await _read(backend, request)
                except CapacityExceeded:
                    if loop.time() >= deadline:
                        raise
                await asyncio.sleep(CAPACITY_POLL_S)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(request)) for request in requests]
    except BaseExceptionGroup as failed:
        raise _first(failed) from None
    return [task.result() for task in tasks]


async def _read(backend: GenerationBackend, request: GenerationRequest) -> tuple[float, ...]:
    events = backend.generate(request)
    try:
        async for event in events:
            if event.embedding:
                return event.embedding
            if event.finish_reason is not None:
                break
    finally:
        await events.aclose()
    raise Unavailable(
        f"request {request.request_id} ended without its embedding; retry the request"
    )


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error to answer with: a mesh error (it has an HTTP status) before others."""
    errors = list(_leaves(group))
    return next((e for e in errors if isinstance(e, MeshError)), errors[0])


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def unit_length(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to Euclidean length 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else [0.0 for _ in vector]


def answer(
    body: EmbeddingBody,
    vectors: Sequence[Sequence[float]],
    inputs: Sequence[list[int]],
    model_id: str,
) -> dict[str, Any]:
    """The response body: OpenAI's list of embeddings, with usage."""
    size = len(vectors[0]) if vectors else 0
    if body.dimensions is not None and body.dimensions != size:
        raise bad_request(_dimensions_message(body.dimensions, size), "dimensions")
    data = []
    for index, vector in enumerate(vectors):
        scaled = unit_length(vector)
        value: Any = scaled
        if body.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(scaled)}f", *scaled)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(len(item) for item in inputs)
    return {
        "object": "list",
        "data": data,
        "model": model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
