"""The HTTP server around the app: uvicorn in a background thread (``serve_app`` /
``stop_server``), and the request body read as one bounded JSON object."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import threading
import time
from typing import Any

import uvicorn
from fastapi import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from mesh.errors import Unavailable
from stage.frontend.errors import OpenAIError, bad_request

logger = logging.getLogger(__name__)

# A connection must deliver a request's headers this long after it opens (or after
# its last response): one that sends nothing, or a header line now and then, is
# closed instead of holding a file descriptor for ever.
REQUEST_HEADERS_TIMEOUT_S = 15.0
# A request's body must arrive within this grace period plus one second for every
# REQUEST_BODY_MIN_RATE bytes received (4 MB, the default body limit, may take
# about 17 minutes), else 408: a client that stalls mid-body is let go.
REQUEST_BODY_GRACE_S = 15.0
REQUEST_BODY_MIN_RATE = 4096
# Connections held at once, as a share of the process's file-descriptor limit (the
# rest is for gRPC, links and files); more are closed as they arrive.
CONNECTION_FD_SHARE = 0.75
MAX_CONNECTIONS = 10_000


def connection_cap() -> int:
    """The most HTTP connections this process holds at once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(32, min(MAX_CONNECTIONS, int(soft * CONNECTION_FD_SHARE)))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with two limits it lacks: a deadline for the
    headers of each request (uvicorn's keep-alive timeout starts only after a first
    response, and any byte cancels it) and a cap on connections held at once (at the
    cap a new connection closes the one idle longest, or is closed when none is)."""

    max_connections = MAX_CONNECTIONS
    _refused_logged = 0.0

    def connection_made(self, transport: Any) -> None:
        self._headers_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            idle = self._longest_idle()
            if idle is not None:
                # Room for the newcomer: a connection between requests (kept alive,
                # or never used) gives way, the one waiting longest first.
                idle._stop_waiting()
                idle.transport.close()
                self._log_full("closing idle ones to make room")
            else:
                self._log_full("every one is serving a request; closing new ones as they come")
                transport.close()
                return
        self._await_headers()

    def _longest_idle(self) -> GuardedH11Protocol | None:
        """The held connection that has waited longest for a request's headers (none
        while every one is serving a request)."""
        idle = [
            p
            for p in self.connections
            if p is not self
            and getattr(p, "_headers_timer", None) is not None
            and not p.transport.is_closing()
        ]
        return min(idle, key=lambda p: p._headers_timer.when(), default=None)

    def _log_full(self, action: str) -> None:
        now = time.monotonic()
        if now - GuardedH11Protocol._refused_logged > 10.0:
            GuardedH11Protocol._refused_logged = now
            logger.warning(
                "HTTP: %d connections held, the limit (a share of the open-file limit); %s",
                len(self.connections) - 1,
                action,
            )

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._headers_timer = self.loop.call_later(REQUEST_HEADERS_TIMEOUT_S, self._headers_overdue)

    def _stop_waiting(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_overdue(self) -> None:
        self._headers_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        # Armed first: a pipelined request that starts inside stops it again.
        self._await_headers()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)


class _OncePerInterval(logging.Filter):
    """Lets one record of a kind through per ``interval_s``: asyncio logs a failed
    accept (out of file descriptors) with a traceback on every retry."""

    def __init__(self, marker: str, interval_s: float) -> None:
        super().__init__()
        self.marker = marker
        self.interval_s = interval_s
        self._last = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.marker not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


_ACCEPT_FILTER = _OncePerInterval("out of system resource", 10.0)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 above ``max_bytes``, 400 when not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("the Content-Length header is not a number", code="invalid_header")
        if int(declared) > max_bytes:
            raise OpenAIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        # The body's bytes must keep up an average rate after a grace period: one
        # that stalls (or trickles) would hold its connection, and a place under the
        # connection cap, for ever.
        due = started + REQUEST_BODY_GRACE_S + size / REQUEST_BODY_MIN_RATE
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, due - loop.time()))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise OpenAIError(
                408,
                f"the request body arrived too slowly ({size} bytes in "
                f"{loop.time() - started:.0f} s; it must come at {REQUEST_BODY_MIN_RATE} "
                f"bytes/s on average after the first {REQUEST_BODY_GRACE_S:.0f} s); "
                "send it again",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        payload = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(payload, "")
        if where is not None:
            raise bad_request(
                f"the request holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without "
                f"its pair) in {where or 'a key'}: text must be valid Unicode",
                where or None,
                code="invalid_unicode",
            )
    return payload


# A JSON escape of a UTF-16 surrogate: the only way a lone one gets into a string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (``a.b[2]``) of the first string or key of ``value`` holding a lone
    surrogate, which no encoder (the tokenizer, the grammar library) takes; None
    when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if _lone_surrogate(key, path) is not None:
                return path
            found = _lone_surrogate(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def serve_app(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    startup_timeout_s: float = 30.0,
    graceful_shutdown_s: float = 5.0,
    log_level: str = "warning",
) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Run ``app`` with uvicorn in a daemon thread; return (server, thread, bound port).

    ``port=0`` lets the OS pick a free port. Stop with ``stop_server(server, thread)``.
    """
    GuardedH11Protocol.max_connections = connection_cap()
    if _ACCEPT_FILTER not in logging.getLogger("asyncio").filters:
        logging.getLogger("asyncio").addFilter(_ACCEPT_FILTER)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=graceful_shutdown_s,
        http=GuardedH11Protocol,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"http {host}:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise Unavailable(f"the HTTP server on {host}:{port} failed to start; see the log")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise Unavailable(
                f"the HTTP server on {host}:{port} did not start within {startup_timeout_s} s"
            )
        time.sleep(0.01)
    bound_port = int(server.servers[0].sockets[0].getsockname()[1])
    logger.info("serving HTTP on %s:%d", host, bound_port)
    return server, thread, bound_port


def stop_server(server: uvicorn.Server, thread: threading.Thread, timeout_s: float = 10.0) -> None:
    """Ask uvicorn to exit and wait for its thread."""
    server.should_exit = True
    thread.join(timeout_s)
    if thread.is_alive():
        server.force_exit = True
        thread.join(timeout_s)
