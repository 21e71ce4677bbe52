"""The backend contract's edge cases, with scripted events from a fake engine:
multi-token rounds, stop tokens, over-delivery, speculation stats, mid-stream
errors, and a backend bug (the one path allowed to reach the catch-all 500)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, assert_openai_error, live_server

from mesh.errors import CapacityExceeded, InvalidRequest, Unavailable
from stage.frontend.backend import GenerationStats, TokenEvent

EOS = 2
COMPLETION = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 50}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text))


@pytest.fixture()
def serve(tokenizer) -> Iterator:
    """serve(events, **app_kwargs) -> (base_url, backend); servers stop at teardown."""
    stack: list = []

    def start(events, internal_errors: int = 0, **kwargs):
        backend = ScriptedBackend(events)
        ctx = live_server(backend, tokenizer, internal_errors=internal_errors, **kwargs)
        url = ctx.__enter__()
        stack.append(ctx)
        return url, backend

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


def sse_payloads(response: httpx.Response) -> list:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_multi_token_rounds_and_stop_token_mid_round(serve, tokenizer) -> None:
    events = [
        TokenEvent(ids(tokenizer, "Hello big")),
        TokenEvent((*ids(tokenizer, " world"), EOS, *ids(tokenizer, " junk"))),
        TokenEvent(ids(tokenizer, " never seen"), "length"),
    ]
    url, backend = serve(events)
    reply = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).json()
    assert reply["choices"][0]["text"] == "Hello big world"
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len(ids(tokenizer, "Hello big world"))
    assert len(backend.closed.wait_for(1, timeout_s=5.0)) == 1


def test_over_delivery_is_cut_at_max_tokens(serve, tokenizer) -> None:
    url, _ = serve([TokenEvent(ids(tokenizer, "one two three four five six"))])
    body = {**COMPLETION, "max_tokens": 3}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert reply["usage"]["completion_tokens"] == 3
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["text"] == tokenizer.decode(ids(tokenizer, "one two three four")[:3])


def test_speculation_stats_become_timings(serve, tokenizer) -> None:
    stats = GenerationStats(
        prompt_tokens=1,
        completion_tokens=4,
        prompt_ms=12.5,
        decode_ms=40.0,
        speculation={
            "drafted": 6,
            "accepted": 3,
            "accept_rate": 0.5,
            "windows": 2,
            "tokens_per_round": 2.0,
        },
    )
    events = [TokenEvent(ids(tokenizer, " a b")), TokenEvent(ids(tokenizer, " c d"), "stop", stats)]
    url, _ = serve(events)
    reply = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["timings"] == {
        "prompt_n": 1,
        "prompt_ms": 12.5,
        "predicted_n": 4,
        "predicted_ms": 40.0,
        "predicted_per_second": 100.0,
        "drafted": 6,
        "accepted": 3,
        "accept_rate": 0.5,
        "windows": 2,
        "tokens_per_round": 2.0,
    }


def test_generator_ending_without_finish_reason_reports_stop(serve, tokenizer) -> None:
    url, _ = serve([TokenEvent(ids(tokenizer, "done"))])
    reply = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).json()
    assert reply["choices"][0] == {
        "index": 0,
        "text": "done",
        "logprobs": None,
        "finish_reason": "stop",
    }


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (CapacityExceeded("all 4 sessions are busy"), 429),
        (Unavailable("stage 1 is gone"), 503),
        (InvalidRequest("prompt exceeds the KV budget of stage 2"), 400),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_admission_errors_keep_their_status(serve, error, status: int, stream: bool) -> None:
    url, _ = serve([error])
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "stream": stream})
    body = assert_openai_error(response, status)
    assert error.message in body["message"]
    if status in (429, 503):
        assert response.headers["retry-after"] == "1"


def test_mid_stream_error_ends_the_stream_with_an_error_event(serve, tokenizer) -> None:
    url, backend = serve([TokenEvent(ids(tokenizer, "partial")), Unavailable("stage 1 died")])
    body = {**COMPLETION, "stream": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    payloads = sse_payloads(response)
    assert payloads[0]["choices"][0]["text"] == "partial"
    assert payloads[-1]["error"]["type"] == "service_unavailable"
    assert "stage 1 died" in payloads[-1]["error"]["message"]
    assert "[DONE]" not in payloads
    non_stream = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30)
    assert_openai_error(non_stream, 503)
    assert len(backend.closed.wait_for(2, timeout_s=5.0)) == 2


def test_stop_string_closes_the_generator_early(serve, tokenizer) -> None:
    events = [
        TokenEvent(ids(tokenizer, "keep this")),
        TokenEvent(ids(tokenizer, " END and more")),
        TokenEvent(ids(tokenizer, " unreachable"), "length"),
    ]
    url, backend = serve(events)
    body = {**COMPLETION, "stop": ["END"], "stream": True}
    payloads = sse_payloads(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
    text = "".join(p["choices"][0]["text"] for p in payloads if isinstance(p, dict))
    assert text == "keep this " and payloads[-1] == "[DONE]"
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(backend.closed.wait_for(1, timeout_s=5.0)) == 1


def test_backend_bug_is_an_openai_shaped_500(serve) -> None:
    url, _ = serve([RuntimeError("engine bug")], internal_errors=1)
    response = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30)
    assert_openai_error(response, 500, code="internal_error")
    assert "engine bug" not in response.text


def test_a_stage_s_unexpected_error_is_counted_as_an_internal_error(serve, tokenizer) -> None:
    """A stage's unexpected exception reaches stage 0 as an untyped mesh error (500):
    counted in mesh_http_internal_errors_total whether the answer is a 500 or a
    stream's last event (live_server checks the count)."""
    from mesh.errors import MeshError

    failure = MeshError("stage 1: RuntimeError: boom")
    url, _ = serve([TokenEvent(ids(tokenizer, "partial")), failure], internal_errors=2)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30), 500)
    body = {**COMPLETION, "stream": True}
    payloads = sse_payloads(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
    assert "boom" in payloads[-1]["error"]["message"]
