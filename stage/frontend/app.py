"""The OpenAI-compatible HTTP frontend of stage 0.

``create_app`` builds the FastAPI app over a ``GenerationBackend`` and a Hugging
Face tokenizer; ``http_server.serve_app`` runs it with uvicorn in a background thread.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE
streaming); other APIs translated into chat requests: ``POST /v1/responses``
(OpenAI's Responses API, responses.py), ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic's, anthropic.py); ``POST
/v1/embeddings`` (embeddings.py); llama.cpp's own
``POST /completion``, ``POST /infill``, ``GET /props``, ``POST /apply-template``
(llama_api.py, infill.py); ``POST /tokenize``,
``POST /detokenize``; ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``,
``GET /metrics``. With an API key configured, every ``/v1`` route needs
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open for load
balancers and scrapers. Every error is an OpenAI error body (see errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from mesh.api_keys import NO_LIMITS, KeySource, key_source, request_tenant
from mesh.errors import CapacityExceeded, MeshError, Unavailable
from mesh.metrics import CONTENT_TYPE_LATEST, generate_latest
from stage.frontend import anthropic, anthropic_answer, embeddings, tokenize
from stage.frontend.backend import GenerationBackend
from stage.frontend.errors import (
    OpenAIError,
    bad_request,
    from_mesh_error,
    from_validation_error,
    install_error_handlers,
)
from stage.frontend.fim import fim_tokens
from stage.frontend.generation import GenerationRun
from stage.frontend.http_server import read_json_object
from stage.frontend.llama_routes import PATHS as LLAMA_PATHS
from stage.frontend.llama_routes import add_llama_routes
from stage.frontend.prepare import (
    FrontendLimits,
    PromptContext,
    checked_chat_prompt,
    prepare_chat,
    prepare_completion,
)
from stage.frontend.response_store import ResponseStore
from stage.frontend.responses_routes import (
    RESPONSES_PATH,
    add_response_routes,
    parse_response_request,
)
from stage.frontend.schemas import ChatCompletionBody, CompletionBody
from stage.frontend.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    final_body,
    sse_events,
    until_disconnect,
)
from stage.frontend.telemetry import CLIENT_CLOSED_STATUS, EdgeMiddleware, FrontendMetrics
from stage.frontend.tenant_rates import TenantRates
from stage.frontend.tenant_slots import TenantSlots
from stage.frontend.translated import AnswerShape, collect_text, serve_run

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
TOKEN_PATHS = ("/tokenize", "/detokenize")
ENDPOINTS = (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    COUNT_TOKENS_PATH,
    RESPONSES_PATH,
    "/v1/embeddings",
    *LLAMA_PATHS,
    *TOKEN_PATHS,
    "/v1/models",
    "/v1/models/{model:path}",
    RESPONSES_PATH + "/{response_id}",
    RESPONSES_PATH + "/{response_id}/input_items",
    "/health",
    "/metrics",
)


class _Frontend:
    """The state behind the routes."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        model_id: str,
        api_keys: KeySource | None,
        max_request_bytes: int,
        limits: FrontendLimits,
        stop_token_ids: frozenset[int],
        metrics: FrontendMetrics,
        fingerprint: str | None,
        embedding_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.api_keys = api_keys
        self.max_request_bytes = max_request_bytes
        self.limits = limits
        self.metrics = metrics
        self.stop_token_ids = stop_token_ids
        self.fingerprint = fingerprint
        self.created = int(time.time())
        self.tenant_slots = TenantSlots(metrics.tenant_running)
        self.tenant_rates = TenantRates(metrics.tenant_rate_limited)
        self.fim = fim_tokens(tokenizer)
        self.responses = ResponseStore(limits.stored_responses)
        # The length of the model's embeddings (its hidden size), where known.
        self.embedding_size = embedding_size
        # Requests waiting for the pipeline to come back (``check_ready``): they count
        # against the backend's request capacity like queued ones.
        self.waiting_for_pipeline = 0

    def prompt_context(self, request: Request | None = None) -> PromptContext:
        # Read per request: a backend learns its context length when the pipeline loads.
        return PromptContext(
            tokenizer=self.tokenizer,
            model_id=self.model_id,
            context_length=self.backend.context_length,
            stop_token_ids=self.stop_token_ids,
            limits=self.limits,
            fingerprint=self.fingerprint,
            tenant=getattr(request.state, "tenant", "") if request is not None else "",
            fim=self.fim,
            check_grammar=getattr(self.backend, "check_grammar", None),
            model_vocab=getattr(self.backend, "vocab_size", 0) or 0,
        )

    def authorize(self, request: Request) -> str:
        """The request's tenant ("" when the server has no keys), from the API key as
        ``Authorization: Bearer`` (OpenAI clients) or ``x-api-key`` (Anthropic
        clients); 401 without a valid one. Also kept as ``request.state.tenant``."""
        tenant = ""
        if self.api_keys is not None:
            found = request_tenant(self.api_keys, request.headers)
            if found is None:
                raise OpenAIError(
                    401,
                    "missing or invalid API key; send it as 'Authorization: Bearer <key>'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            tenant = found
        request.state.tenant = tenant
        return tenant

    def claim_slots(
        self, tenant: str, count: int, prompt_tokens: int = 0
    ) -> list[Callable[[int], None]]:
        """``count`` of the tenant's generation slots (its key's ``max_concurrent``)
        and one request of its rate (``rpm``, ``tpm``: the prompt's tokens now, each
        generation's completion tokens when it is released with them); 429 when its
        key runs too many already or is over its rate."""
        limits = NO_LIMITS
        if self.api_keys is not None and tenant:
            limits = self.api_keys.limits_of(tenant)
        slots = self.tenant_slots.claim(tenant, count, limits.max_concurrent)
        try:
            self.tenant_rates.admit(tenant, limits, prompt_tokens)
        except OpenAIError:
            for release in slots:
                release()
            raise

        def charged(release: Callable[[], None]) -> Callable[[int], None]:
            def release_with(completion_tokens: int = 0) -> None:
                release()
                self.tenant_rates.charge(tenant, limits, completion_tokens)

            return release_with

        return [charged(release) for release in slots]

    async def check_ready(self) -> None:
        """Serve now, or after the reload in progress; else 503 with the reason. A
        request that would wait for the pipeline while the generations running and
        queued and the requests already waiting fill the backend's capacity gets 429
        at once: the queue stays bounded while no pipeline answers."""
        capacity = getattr(self.backend, "request_capacity", None)
        if capacity is not None and not self.backend.ready():
            taken = getattr(self.backend, "active_requests", 0) + self.waiting_for_pipeline
            if taken >= capacity:
                raise CapacityExceeded(
                    f"{capacity} requests are running, queued or waiting for the pipeline "
                    "to come back, the limit; retry shortly"
                )
        self.waiting_for_pipeline += 1
        try:
            if await self.backend.wait_ready():
                return
        finally:
            self.waiting_for_pipeline -= 1
        reason = self.backend.unavailable_reason() or "the pipeline is not ready"
        raise Unavailable(f"the model is not ready to serve: {reason}; retry shortly")

    async def tokens(
        self,
        request: Request,
        answer: Callable[[dict[str, Any], PromptContext], Awaitable[dict[str, Any]]],
    ) -> dict[str, Any]:
        """``/tokenize`` or ``/detokenize`` (stage/frontend/tokenize.py): the
        tokenizer alone, no pipeline needed."""
        payload = await self.payload(request)
        if payload is None:
            return {}
        return await answer(payload, self.prompt_context())

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "mesh",
            "context_length": self.backend.context_length,
            # vLLM's name for the same, which some clients read.
            "max_model_len": self.backend.context_length,
        } | self._speculation()

    def _speculation(self) -> dict[str, Any]:
        summary = getattr(self.backend, "speculation_summary", None)
        return {"speculation": summary()} if summary is not None else {}

    async def generate(self, request: Request, kind: Literal["chat", "completion"]) -> Response:
        arrival = time.perf_counter()
        payload = await self.payload(request)
        if payload is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        try:
            if kind == "chat":
                body: Any = ChatCompletionBody.model_validate(payload)
            else:
                body = CompletionBody.model_validate(payload)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        await self.check_ready()
        if kind == "chat":
            prepared = await prepare_chat(body, self.prompt_context(request))
        else:
            prepared = await prepare_completion(body, self.prompt_context(request))
        endpoint = CHAT_PATH if kind == "chat" else COMPLETIONS_PATH
        logger.debug(
            "request %s: %d prompt tokens, budget %d, user %r",
            prepared.response_id,
            len(prepared.request.prompt_tokens),
            prepared.request.max_new_tokens,
            body.user,
        )
        choices = prepared.choice_requests()
        capacity = getattr(self.backend, "request_capacity", None)
        if capacity is not None and len(choices) > capacity:
            # Never admitted whole, however long the client retries: not a 429.
            raise bad_request(
                f"this request asks for {len(choices)} choices (prompts times n), but the "
                f"server admits at most {capacity} generations at once (its concurrent "
                "requests plus its queue); send fewer prompts or a smaller n",
                "n" if len(prepared.requests) == 1 else "prompt",
            )
        prompt_tokens = sum(len(r.prompt_tokens) for r in prepared.requests)
        releases = self.claim_slots(prepared.request.tenant, len(choices), prompt_tokens)
        runs = [
            GenerationRun(
                self.backend, prepared, self.tokenizer, self.metrics, endpoint, arrival, r, i,
                release=release,
            )
            for i, (r, release) in enumerate(zip(choices, releases, strict=True))
        ]  # fmt: skip

        async def close() -> None:
            await asyncio.gather(*(run.aclose() for run in runs))

        handed_over = False
        try:
            # Submitted in order: each prompt's first choice reads it first, the
            # prompt's other choices start from a copy of it.
            await until_disconnect(request.receive, _start_all(runs))
            if prepared.stream:
                events = sse_events(runs, self.metrics, self.limits.retry_after_s)
                handed_over = True
                return EventStreamResponse(events, on_close=close)
            texts = await until_disconnect(
                request.receive, asyncio.gather(*(collect_text(run) for run in runs))
            )
            return JSONResponse(final_body(runs, list(texts)))
        except ClientDisconnected:
            logger.info("client left before request %s finished", prepared.response_id)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            if not handed_over:
                await close()

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings`` (stage/frontend/embeddings.py)."""
        payload = await self.payload(request)
        if payload is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        try:
            body = embeddings.EmbeddingBody.model_validate(payload)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        ctx = self.prompt_context(request)
        embeddings.check_body(body, ctx, self.embedding_size)
        await self.check_ready()
        ctx = self.prompt_context(request)  # the loaded pipeline's context length
        inputs = await asyncio.to_thread(embeddings.input_tokens, body, ctx)
        tokens = sum(len(item) for item in inputs)
        window = min(len(inputs), embeddings.EMBED_WINDOW)
        capacity = getattr(self.backend, "request_capacity", None)
        if capacity is not None:
            free = capacity - getattr(self.backend, "active_requests", 0)
            if free <= 0:
                raise CapacityExceeded(
                    f"{capacity} requests are running or queued, the limit; retry shortly"
                )
            window = min(window, free)
        if self.api_keys is not None and ctx.tenant:
            window = min(window, self.api_keys.limits_of(ctx.tenant).max_concurrent or window)
        releases = self.claim_slots(ctx.tenant, window, tokens)
        requests = embeddings.embedding_requests(inputs, self.limits.embedding_pooling, ctx.tenant)
        try:
            vectors = await until_disconnect(
                request.receive, embeddings.embed_all(self.backend, requests, window)
            )
        except ClientDisconnected:
            logger.info("client left before its %d embeddings were read", len(inputs))
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            for release in releases:
                release(0)
        self.metrics.prompt_tokens.labels(endpoint=embeddings.EMBEDDINGS_PATH).inc(tokens)
        if ctx.tenant:
            self.metrics.tenant_tokens.labels(tenant=ctx.tenant, kind="prompt").inc(tokens)
        if vectors and self.embedding_size is None:
            self.embedding_size = len(vectors[0])
        return JSONResponse(embeddings.answer(body, vectors, inputs, self.model_id))

    async def payload(self, request: Request) -> dict[str, Any] | None:
        """The authorized request's JSON object; None when the client left while
        sending it."""
        self.authorize(request)
        try:
            return await read_json_object(request, self.max_request_bytes)
        except ClientDisconnect:
            logger.info("client left while sending the request body")
            return None

    async def translated(
        self,
        request: Request,
        endpoint: str,
        parse: Callable[[dict[str, Any]], tuple[ChatCompletionBody, AnswerShape]],
        messages_param: str = "messages",
    ) -> Response:
        """Another API's generation route (stage/frontend/translated.py): ``parse``
        turns the body into its chat twin and the shape to answer in; an error about
        the twin's ``messages`` names ``messages_param``, that API's field."""
        arrival = time.perf_counter()
        payload = await self.payload(request)
        if payload is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        chat, shape = parse(payload)
        await self.check_ready()
        try:
            prepared = await prepare_chat(chat, self.prompt_context(request))
        except OpenAIError as error:
            if error.param == "messages":
                error.param = messages_param
            raise
        prompt_tokens = len(prepared.request.prompt_tokens)
        (release,) = self.claim_slots(prepared.request.tenant, 1, prompt_tokens)
        run = GenerationRun(
            self.backend, prepared, self.tokenizer, self.metrics, endpoint, arrival, release=release
        )
        return await serve_run(request, run, shape)

    def anthropic_message(self, payload: dict[str, Any]) -> tuple[ChatCompletionBody, AnswerShape]:
        body, chat = anthropic.parse_body(payload, self.model_id)
        return chat, anthropic_answer.MessageShape(
            anthropic_answer.new_message_id(), body.model or self.model_id
        )

    def openai_response(
        self, payload: dict[str, Any], request: Request
    ) -> tuple[ChatCompletionBody, AnswerShape]:
        tenant = getattr(request.state, "tenant", "")
        return parse_response_request(payload, self.responses, tenant, self.model_id)

    async def response_input_tokens(self, request: Request) -> Response:
        """``POST /v1/responses/input_tokens``: the prompt tokens a Responses request
        would take (its stored previous turns included), by the tokenizer alone."""
        payload = await self.payload(request)
        if payload is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        chat, _ = self.openai_response({"model": self.model_id, **payload}, request)
        try:
            prompt = await checked_chat_prompt(chat, self.prompt_context())
        except OpenAIError as error:
            if error.param == "messages":
                error.param = "input"
            raise
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt)})

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: the tokenizer alone, no pipeline needed."""
        payload = await self.payload(request)
        if payload is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(await anthropic.count_tokens(payload, self.prompt_context()))


def _anthropic_error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        anthropic_answer.error_response_body(error), status_code=error.status, headers=error.headers
    )


async def _start_all(runs: list[GenerationRun]) -> None:
    """Start every choice; when one cannot start, the error of the first that failed
    is raised (the caller closes them all)."""
    results = await asyncio.gather(*(run.start() for run in runs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def create_app(
    backend: GenerationBackend,
    tokenizer: Any,
    *,
    model_id: str,
    api_key: KeySource | str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    cors_origins: Sequence[str] | None = None,
    limits: FrontendLimits | None = None,
    stop_token_ids: Iterable[int] | None = None,
    metrics: FrontendMetrics | None = None,
    fingerprint: str | None = None,
    embedding_size: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``model_id`` through ``backend``.

    ``tokenizer`` is a Hugging Face tokenizer (chat template, encode, decode).
    ``stop_token_ids`` default to the tokenizer's EOS token. ``metrics`` lets the
    caller share a registry (stage 0: its process's); by default the app has its own.
    ``fingerprint`` is answered as ``system_fingerprint`` (it names the weights being
    served). ``embedding_size`` is the length of the model's embeddings (its
    hidden size), where the caller knows it.
    """
    if max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
    limits = limits or FrontendLimits()
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_token_ids = () if eos is None else (eos,)
    metrics = metrics or FrontendMetrics()
    front = _Frontend(
        backend,
        tokenizer,
        model_id,
        key_source(api_key),
        max_request_bytes,
        limits,
        frozenset(int(t) for t in stop_token_ids),
        metrics,
        fingerprint,
        embedding_size,
    )
    app = FastAPI(title="mesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = front
    app.state.metrics = metrics
    install_error_handlers(app, limits.retry_after_s)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, "chat")

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await front.generate(request, "completion")

    async def in_anthropic_shape(answer: Awaitable[Response]) -> Response:
        try:
            return await answer
        except OpenAIError as error:
            return _anthropic_error(error)
        except MeshError as exc:
            return _anthropic_error(from_mesh_error(exc, limits.retry_after_s))

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        return await in_anthropic_shape(
            front.translated(request, MESSAGES_PATH, front.anthropic_message)
        )

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request) -> Response:
        return await in_anthropic_shape(front.count_tokens(request))

    @app.post(RESPONSES_PATH)
    async def create_response(request: Request) -> Response:
        return await front.translated(
            request,
            RESPONSES_PATH,
            lambda payload: front.openai_response(payload, request),
            messages_param="input",
        )

    @app.post(RESPONSES_PATH + "/input_tokens")
    async def response_input_tokens(request: Request) -> Response:
        return await front.response_input_tokens(request)

    add_response_routes(app, front)

    add_llama_routes(app, front)

    @app.post(embeddings.EMBEDDINGS_PATH)
    async def create_embeddings(request: Request) -> Response:
        return await front.embeddings(request)

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> JSONResponse:
        return JSONResponse(await front.tokens(request, tokenize.tokenize))

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request) -> JSONResponse:
        return JSONResponse(await front.tokens(request, tokenize.detokenize))

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        front.authorize(request)
        return JSONResponse({"object": "list", "data": [front.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> JSONResponse:
        front.authorize(request)
        if model != model_id:
            raise OpenAIError(
                404, f"model {model!r} is not served here", param="model", code="model_not_found"
            )
        return JSONResponse(front.model_card())

    # HEAD too: load balancers and uptime checks often probe with it.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if backend.ready():
            return JSONResponse({"status": "ok"})
        reason = backend.unavailable_reason() or "the pipeline is not ready"
        headers = {"Retry-After": str(limits.retry_after_s)}
        return JSONResponse(
            {"status": "unavailable", "reason": reason}, status_code=503, headers=headers
        )

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        # In a thread: a stage's collector waits for its runtime between frames.
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(EdgeMiddleware, metrics=metrics, endpoints=ENDPOINTS)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    return app
