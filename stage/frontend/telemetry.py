"""Frontend metrics and the ASGI edge middleware that records them.

The middleware sits just inside Starlette's error middleware. It counts every
response by endpoint and status, times it (to the last byte, so a stream is timed
whole), and is the catch-all: an exception that escapes the app is logged and
answered with an OpenAI-shaped 500, and counted in
``mesh_http_internal_errors_total`` (which tests assert stays at zero).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh.metrics import Registry

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
UNMATCHED_ENDPOINT = "unmatched"
# nginx's convention for "the client closed the connection before the answer".
CLIENT_CLOSED_STATUS = 499


class FrontendMetrics:
    """The HTTP layer's series, registered in ``registry``."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        r = self.registry
        self.requests = r.counter(
            "mesh_http_requests_total",
            "HTTP requests by endpoint and status.",
            ("endpoint", "status"),
        )
        self.request_seconds = r.histogram(
            "mesh_http_request_duration_seconds",
            "Time from request arrival to the last byte of the response.",
            ("endpoint",),
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = r.counter(
            "mesh_prompt_tokens_total", "Prompt tokens of accepted generations.", ("endpoint",)
        )
        self.completion_tokens = r.counter(
            "mesh_completion_tokens_total", "Generated tokens.", ("endpoint",)
        )
        self.time_to_first_token = r.histogram(
            "mesh_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            ("endpoint",),
            LATENCY_BUCKETS,
        )
        self.time_per_output_token = r.histogram(
            "mesh_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            ("endpoint",),
            TOKEN_LATENCY_BUCKETS,
        )
        self.active_requests = r.gauge(
            "mesh_active_requests", "Generations in flight in the HTTP layer."
        )
        self.internal_errors = r.counter(
            "mesh_http_internal_errors_total", "Requests that ended in an unexpected exception."
        )


class EdgeMiddleware:
    """Counts and times every HTTP response; turns escaped exceptions into 500s."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else UNMATCHED_ENDPOINT
        started = time.perf_counter()
        status = CLIENT_CLOSED_STATUS
        response_started = False

        async def send_recording(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = int(message["status"])
                response_started = True
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        except Exception:
            self.metrics.internal_errors.inc()
            logger.exception("unexpected error serving %s %s", scope.get("method"), path)
            if response_started:
                raise
            status = 500
            await _send_internal_error(send)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            self.metrics.request_seconds.labels(endpoint=endpoint).observe(
                time.perf_counter() - started
            )


async def _send_internal_error(send: Send) -> None:
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
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
