"""While stage 0 drains, every route that starts work on the pipeline gets 503 and
the others (reads, the tokenizer) go on (stage/frontend/host.py)."""

from __future__ import annotations

import asyncio

import pytest

from stage.frontend.host import SwitchableApp

WORK = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
WORK += ["/v1/embeddings", "/completion", "/infill"]


def answer(app: SwitchableApp, method: str, path: str) -> int:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def ok_app() -> SwitchableApp:
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    switch = SwitchableApp()
    switch.current = app
    return switch


@pytest.mark.parametrize("path", WORK)
def test_work_is_refused_while_draining(path: str) -> None:
    switch = ok_app()
    assert answer(switch, "POST", path) == 200
    switch.draining = True
    assert answer(switch, "POST", path) == 503


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/messages/count_tokens")],
)
def test_reads_go_on_while_draining(method: str, path: str) -> None:
    switch = ok_app()
    switch.draining = True
    assert answer(switch, method, path) == 200
    assert answer(switch, "GET", "/health") == 503
