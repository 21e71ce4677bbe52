"""The HTTP server's own limits: a connection that sends no request headers (idle,
or a header line now and then) is closed after the headers deadline, and
at the cap a new connection closes the one idle longest (or is closed itself while
every one serves a request), so that connections cannot hold every file descriptor
of stage 0 while clients wait."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from fastapi import FastAPI

from stage.frontend import http_server
from stage.frontend.http_server import serve_app, stop_server


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(http_server, "REQUEST_HEADERS_TIMEOUT_S", 1.0)
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(1.5)
        return {"ok": True}

    def start(cap: int | None = None):
        if cap is not None:
            monkeypatch.setattr(http_server, "connection_cap", lambda: cap)
        running = serve_app(app, "127.0.0.1", 0)
        started.append(running)
        return running[2]

    started: list = []
    yield start
    for srv, thread, _ in started:
        stop_server(srv, thread)


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``);
    ``drip`` is sent every 0.2 s meanwhile, as a slow client sends header bytes."""
    sock.settimeout(0.2)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if drip:
                sock.sendall(drip)
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    return None


def test_a_connection_without_request_headers_is_closed(server) -> None:
    port = server()
    with socket.create_connection(("127.0.0.1", port)) as idle:
        closed = _closed_within(idle, 10)
        assert closed is not None and closed < 5
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET /ping HTTP/1.1\r\n")
        closed = _closed_within(slow, 10, drip=b"X")  # a header that never ends
        assert closed is not None and closed < 5
    # A client that sends its request in time is served, and its connection kept
    # for the next one.
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.get("/ping").json() == {"ok": True}
        assert client.get("/ping").json() == {"ok": True}


def test_at_the_cap_a_new_connection_closes_the_one_idle_longest(server) -> None:
    port = server(cap=4)
    held = []
    try:
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).json() == {"ok": True}
        assert _closed_within(held[0], 0.8) is not None  # the oldest made room
        assert all(_closed_within(sock, 0.2) is None for sock in held[1:])
    finally:
        for sock in held:
            sock.close()


def test_connections_beyond_the_cap_are_closed_while_all_serve_requests(server) -> None:
    port = server(cap=4)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        for sock in held:  # a request each, its response held back
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            closed = _closed_within(extra, 0.8)
            assert closed is not None  # at once, not after the headers deadline
        for sock in held:
            sock.settimeout(10)
            assert b"200 OK" in sock.recv(1024)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).json() == {"ok": True}
