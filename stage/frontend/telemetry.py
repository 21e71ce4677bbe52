"""Frontend metrics and the ASGI edge middleware that records them.

The middleware sits just inside Starlette's error middleware. It counts every
response by endpoint and status when it ends, however it ends: a response whose
client left before its last byte (a stream the client abandoned, a request the
client dropped) is counted as 499, not as the status it started with. It times each
response to its last byte (so a stream is timed whole), keeps the requests in
flight, and is the catch-all: an exception that escapes the app is logged and
answered with an OpenAI-shaped 500, and counted in
``mesh_http_internal_errors_total`` (which tests assert stays at zero).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.metrics import LATENCY_BUCKETS_S, STEP_BUCKETS_S

logger = logging.getLogger(__name__)

UNMATCHED_ENDPOINT = "unmatched"
# nginx's convention for "the client closed the connection before the answer".
CLIENT_CLOSED_STATUS = 499


class FrontendMetrics:
    """The HTTP layer's series, registered in ``registry`` (a new one by default;
    stage 0 passes its process's)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mesh_http_requests_total",
            "HTTP requests by endpoint and status, counted when the response ends (499: "
            "the client left before the last byte).",
            ("endpoint", "status"),
            registry=r,
        )
        self.request_seconds = Histogram(
            "mesh_http_request_duration_seconds",
            "Time from request arrival to the last byte of the response.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "mesh_http_requests_in_flight",
            "HTTP requests being answered, by endpoint.",
            ("endpoint",),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mesh_prompt_tokens_total",
            "Prompt tokens of accepted generations.",
            ("endpoint",),
            registry=r,
        )
        self.completion_tokens = Counter(
            "mesh_completion_tokens_total",
            "Generated tokens, counted as they are produced.",
            ("endpoint",),
            registry=r,
        )
        self.generations = Counter(
            "mesh_generations_total",
            "Generations (choices) by how they ended: a stop token (stop), a stop string "
            "(stop_string), the token budget (length), an error, or closed before "
            "finishing (cancelled: the client left).",
            ("endpoint", "reason"),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "mesh_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "mesh_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            ("endpoint",),
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "mesh_tenant_tokens_total",
            "Prompt and generated tokens by tenant (the name its API key has in the key "
            "file); only with API keys.",
            ("tenant", "kind"),
            registry=r,
        )
        self.tenant_running = Gauge(
            "mesh_tenant_running_generations",
            "Generations (choices) each tenant runs now; only with API keys.",
            ("tenant",),
            registry=r,
        )
        self.tenant_rate_limited = Counter(
            "mesh_tenant_rate_limited_total",
            "Requests refused (429) for a tenant's rpm or tpm limit, by the limit "
            "(requests, tokens); only with API keys.",
            ("tenant", "limit"),
            registry=r,
        )
        self.active_requests = Gauge(
            "mesh_active_requests", "Generations in flight in the HTTP layer.", registry=r
        )
        self.internal_errors = Counter(
            "mesh_http_internal_errors_total",
            "Requests answered 500 (or whose stream ended with a 500 error): an "
            "unexpected exception here or on a stage.",
            registry=r,
        )


class EdgeMiddleware:
    """Counts and times every HTTP response; turns escaped exceptions into 500s."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics, endpoints: Collection[str]) -> None:
        """``endpoints``: the routes' paths, the label of their requests; a path with
        parameters (``/v1/responses/{response_id}``) labels every path it matches."""
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(e for e in endpoints if "{" not in e)
        self.templates = [(_template_pattern(e), e) for e in endpoints if "{" in e]

    def endpoint(self, path: str) -> str:
        """The ``endpoint`` label of a request for ``path``."""
        if path in self.endpoints:
            return path
        for pattern, template in self.templates:
            if pattern.fullmatch(path):
                return template
        return UNMATCHED_ENDPOINT

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = self.endpoint(path)
        started = time.perf_counter()
        status = CLIENT_CLOSED_STATUS
        response_started = False
        completed = False

        request_id = _request_id(scope)

        async def send_recording(message: Message) -> None:
            nonlocal status, response_started, completed
            if message["type"] == "http.response.start":
                status = int(message["status"])
                response_started = True
                if status == 500:
                    # A 500 the app answered itself (a stage's unexpected error).
                    self.metrics.internal_errors.inc()
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True

        in_flight = self.metrics.in_flight.labels(endpoint=endpoint)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_recording)
        except Exception:
            if not (response_started and status == 500):
                self.metrics.internal_errors.inc()
            logger.exception(
                "unexpected error serving %s %s (x-request-id %s)",
                scope.get("method"),
                path,
                request_id.decode(),
            )
            if response_started:
                status, completed = 500, True
                raise
            status = 500
            await _send_internal_error(send, request_id)
            completed = True
        finally:
            in_flight.dec()
            if not completed:
                # The client left before the last byte (a stream it abandoned).
                status = CLIENT_CLOSED_STATUS
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            self.metrics.request_seconds.labels(endpoint=endpoint).observe(
                time.perf_counter() - started
            )


def _template_pattern(template: str) -> re.Pattern[str]:
    """A route path's parameters as a pattern: ``{name}`` one path segment,
    ``{name:path}`` the rest of the path."""
    out = ""
    for literal, name in re.findall(r"([^{]*)(\{[^}]*\})?", template):
        out += re.escape(literal)
        if name:
            out += ".+" if name.endswith(":path}") else "[^/]+"
    return re.compile(out)


def _request_id(scope: Scope) -> bytes:
    """The ``x-request-id`` of the response (OpenAI's clients read it as the
    request's id): the client's own when it sent a short printable one, else new."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and 0 < len(value) <= 128 and value.isascii():
            if all(32 < byte < 127 for byte in value):
                return bytes(value)
    return b"req_" + uuid.uuid4().hex.encode()


async def _send_internal_error(send: Send, request_id: bytes) -> None:
    body = json.dumps(
        {
            "error": {
                "message": "internal server error; the server logged the details",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
