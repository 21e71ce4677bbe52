"""Every error the HTTP layer answers: status code, OpenAI body shape, headers.

Also client disconnects: a client that goes away mid-request cancels it in the
backend. The live server fixture fails a test if any request reached the
catch-all 500 handler.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from frontend_support import (
    MODEL_ID,
    TinyModelBackend,
    assert_openai_error,
    live_server,
    metric_value,
)

from mesh.errors import Unavailable
from stage.frontend.streaming import ClientDisconnected, until_disconnect
from stage.frontend.telemetry import FrontendMetrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODY_LIMIT = 64 * 1024
OK_CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION = {"model": MODEL_ID, "prompt": "hello", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_factory("llama", layers=2))


@pytest.fixture(scope="module")
def backend(tiny_model_factory) -> TinyModelBackend:
    return TinyModelBackend(Path(tiny_model_factory("llama", layers=2)))


@pytest.fixture(scope="module")
def base_url(backend, tokenizer) -> Iterator[str]:
    with live_server(backend, tokenizer, max_request_bytes=BODY_LIMIT) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        yield client


@pytest.fixture(autouse=True)
def reset_backend(backend) -> Iterator[None]:
    yield
    backend.set_ready(True)
    backend.reload_wait_s = 0.0
    backend.max_sessions = 16
    backend.fail_with = None
    backend.step_delay_s = 0.0


def with_(body: dict, **changes) -> dict:
    return {**body, **changes}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, with_(OK_CHAT, temperature="hot"), "temperature"),
        (CHAT, with_(OK_CHAT, temperature=-0.5), "temperature"),
        (CHAT, with_(OK_CHAT, temperature=2.5), "temperature"),
        (CHAT, with_(OK_CHAT, temperature=True), "temperature"),
        (CHAT, with_(OK_CHAT, top_p=-0.1), "top_p"),
        (CHAT, with_(OK_CHAT, top_p=1.5), "top_p"),
        (CHAT, with_(OK_CHAT, top_k=-1), "top_k"),
        (CHAT, with_(OK_CHAT, top_k=2.5), "top_k"),
        (CHAT, with_(OK_CHAT, max_tokens=0), "max_tokens"),
        (CHAT, with_(OK_CHAT, max_tokens=1.5), "max_tokens"),
        (CHAT, with_(OK_CHAT, max_tokens="5"), "max_tokens"),
        (CHAT, with_(OK_CHAT, max_completion_tokens=-3), "max_completion_tokens"),
        (CHAT, with_(OK_CHAT, seed=2**70), "seed"),
        (CHAT, with_(OK_CHAT, stream="yes"), "stream"),
        (CHAT, with_(OK_CHAT, stop=7), "stop"),
        (CHAT, with_(OK_CHAT, stop=["a", "b", "c", "d", "e"]), "stop"),
        (CHAT, with_(OK_CHAT, stop=["x" * 300]), "stop"),
        (CHAT, with_(OK_CHAT, stop=""), "stop"),
        (CHAT, with_(OK_CHAT, n=17), "n"),
        (CHAT, with_(OK_CHAT, n=0), "n"),
        (CHAT, with_(OK_CHAT, top_logprobs=3), "top_logprobs"),
        (CHAT, with_(OK_CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
        (CHAT, with_(OK_CHAT, logprobs="yes"), "logprobs"),
        (CHAT, with_(OK_CHAT, tools=[{"type": "function"}]), "tools"),
        (CHAT, with_(OK_CHAT, tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools"),
        (CHAT, with_(OK_CHAT, tool_choice="auto"), "tool_choice"),
        (CHAT, with_(OK_CHAT, tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
        (
            CHAT,
            with_(
                OK_CHAT,
                tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "other"}},
            ),
            "tool_choice",
        ),
        (CHAT, with_(OK_CHAT, tools=[TOOL, TOOL]), "tools"),
        (CHAT, with_(OK_CHAT, tools=[{"type": "function", "function": {"name": "a b"}}]), "tools"),
        (CHAT, with_(OK_CHAT, functions=[TOOL["function"]]), "functions"),
        (
            CHAT,
            with_(
                OK_CHAT,
                messages=[{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}],
            ),
            "messages",
        ),
        (CHAT, with_(OK_CHAT, parallel_tool_calls=False), "parallel_tool_calls"),
        (CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": []}]), "messages"),
        (
            CHAT,
            with_(
                OK_CHAT,
                messages=[
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    {"role": "tool", "content": "42"},
                ],
            ),
            "messages",
        ),
        (CHAT, with_(OK_CHAT, frobnicate=1), "frobnicate"),
        (COMPLETIONS, with_(OK_COMPLETION, typical_p=0.0), "typical_p"),
        (CHAT, with_(OK_CHAT, dry_base=0.5), "dry_base"),
        (CHAT, with_(OK_CHAT, xtc_probability=1.5), "xtc_probability"),
        (CHAT, with_(OK_CHAT, dry_sequence_breakers=[""]), "dry_sequence_breakers"),
        (CHAT, with_(OK_CHAT, dynatemp_exponent=0), "dynatemp_exponent"),
        (CHAT, with_(OK_CHAT, repeat_last_n=-2), "repeat_last_n"),
        (CHAT, with_(OK_CHAT, presence_penalty=2.5), "presence_penalty"),
        (CHAT, with_(OK_CHAT, frequency_penalty="high"), "frequency_penalty"),
        (CHAT, with_(OK_CHAT, repetition_penalty=0), "repetition_penalty"),
        (CHAT, with_(OK_CHAT, min_p=1.5), "min_p"),
        (CHAT, with_(OK_CHAT, logit_bias={"not-a-token": 5}), "logit_bias"),
        (CHAT, with_(OK_CHAT, logit_bias={"-3": 5}), "logit_bias"),
        (CHAT, with_(OK_CHAT, logit_bias={"10000000": 5}), "logit_bias"),
        (CHAT, with_(OK_CHAT, logit_bias={"5": 101}), "logit_bias"),
        (CHAT, with_(OK_CHAT, logit_bias={"5": "up"}), "logit_bias"),
        (CHAT, with_(OK_CHAT, logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
        (CHAT, with_(OK_CHAT, response_format={"type": "yaml"}), "response_format"),
        (CHAT, with_(OK_CHAT, response_format={"type": "json_schema"}), "response_format"),
        (
            CHAT,
            with_(
                OK_CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strange"}},
                },
            ),
            "response_format",
        ),
        (
            CHAT,
            with_(
                OK_CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}},
                },
            ),
            "response_format",
        ),
        (
            CHAT,
            with_(
                OK_CHAT,
                response_format={"type": "json_schema", "json_schema": {"name": "no spaces"}},
            ),
            "response_format",
        ),
        (CHAT, with_(OK_CHAT, guided_choice=[]), "guided_choice"),
        (CHAT, with_(OK_CHAT, guided_choice="yes"), "guided_choice"),
        (CHAT, with_(OK_CHAT, guided_regex="(unclosed"), "guided_regex"),
        (CHAT, with_(OK_CHAT, guided_grammar="root ::= ("), "guided_grammar"),
        (CHAT, with_(OK_CHAT, guided_json="{not json"), "guided_json"),
        (CHAT, with_(OK_CHAT, structured_outputs={}), "structured_outputs"),
        (
            CHAT,
            with_(OK_CHAT, structured_outputs={"regex": "a", "whitespace": 1}),
            "structured_outputs",
        ),
        (
            CHAT,
            with_(OK_CHAT, structured_outputs={"regex": "a", "choice": ["a"]}),
            "structured_outputs",
        ),
        (CHAT, with_(OK_CHAT, guided_regex="a", grammar='start: "a"'), "grammar"),
        (CHAT, with_(OK_CHAT, json_schema={"type": "strange"}), "json_schema"),
        (
            CHAT,
            with_(OK_CHAT, guided_choice=["a"], response_format={"type": "json_object"}),
            "guided_choice",
        ),
        (CHAT, with_(OK_CHAT, stream_options={"include_usage": True}), "stream_options"),
        (CHAT, with_(OK_CHAT, user=["not", "a", "string"]), "user"),
        (CHAT, with_(OK_CHAT, messages=[]), "messages"),
        (CHAT, with_(OK_CHAT, messages="hi"), "messages"),
        (CHAT, with_(OK_CHAT, messages=[{"role": "robot", "content": "x"}]), "messages"),
        (CHAT, with_(OK_CHAT, messages=[{"role": "user"}]), "messages"),
        (CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": 5}]), "messages"),
        (
            CHAT,
            with_(OK_CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages",
        ),
        (CHAT, with_(OK_CHAT, model=5), "model"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=["a"] * 17), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=["a", ""]), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=[]), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=[1, -2]), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=[10**9]), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=""), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt={"text": "x"}), "prompt"),
        (COMPLETIONS, with_(OK_COMPLETION, max_tokens=0), "max_tokens"),
        (COMPLETIONS, with_(OK_COMPLETION, max_tokens=-1, echo=True), "max_tokens"),
        (COMPLETIONS, with_(OK_COMPLETION, echo=1), "echo"),
        (COMPLETIONS, with_(OK_COMPLETION, best_of=3), "best_of"),
        (COMPLETIONS, with_(OK_COMPLETION, logprobs=6), "logprobs"),
        (COMPLETIONS, with_(OK_COMPLETION, logprobs=True), "logprobs"),
        (COMPLETIONS, with_(OK_COMPLETION, suffix="end"), "suffix"),
        (CHAT, with_(OK_CHAT, modalities=["text", "audio"]), "modalities"),
        (CHAT, with_(OK_CHAT, reasoning_effort="huge"), "reasoning_effort"),
        (COMPLETIONS, with_(OK_COMPLETION, n=40), "n"),
        (CHAT, with_(OK_CHAT, stream=True, stream_options={"bogus": True}), "stream_options"),
        (COMPLETIONS, with_(OK_COMPLETION, prompt=[[1, 2], []]), "prompt"),
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": []}]}, "input"),
        (
            CHAT,
            with_(OK_CHAT, prediction={"type": "content", "content": "x", "l": 1}),
            "prediction",
        ),
        (
            COMPLETIONS,
            with_(
                OK_COMPLETION,
                prediction={"type": "content", "content": [{"type": "text", "text": "x", "l": 1}]},
            ),
            "prediction",
        ),
        (CHAT, with_(OK_CHAT, speculation={"max_window": 0}), "speculation"),
        (CHAT, with_(OK_CHAT, speculation={"window": 4}), "speculation"),
    ],
)
def test_bad_parameters_are_400(http, path: str, body: dict, param: str) -> None:
    assert_openai_error(http.post(path, json=body), 400, param=param)


def test_an_error_in_a_member_object_names_fields_not_classes(http) -> None:
    """A union member that is an object is named by its fields alone, and an unknown
    field is named before a missing one."""
    reply = http.post(CHAT, json=with_(OK_CHAT, speculation={"window": 4})).json()
    assert reply["error"]["message"] == (
        "invalid value for 'speculation.window': Extra inputs are not permitted"
    )
    reply = http.post(CHAT, json=with_(OK_CHAT, speculation={"max_window": 99})).json()
    assert "'speculation.max_window'" in reply["error"]["message"]
    assert "Control" not in reply["error"]["message"]


@pytest.mark.parametrize(("path", "field"), [(CHAT, "messages"), (COMPLETIONS, "prompt")])
def test_missing_fields_are_400(http, path: str, field: str) -> None:
    body = dict(OK_CHAT if path == CHAT else OK_COMPLETION)
    del body[field]
    assert_openai_error(http.post(path, json=body), 400, code="missing_field", param=field)


def test_bookkeeping_fields_and_replayed_message_fields_are_accepted(http) -> None:
    """OpenAI's fields that change nothing, and the extra fields of a replayed
    assistant message (as clients send back OpenAI's own message objects)."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
        {"role": "user", "content": "again"},
    ]
    body = with_(OK_CHAT, messages=messages, metadata={"k": "v"}, store=False)
    reply = http.post(CHAT, json=body)
    assert reply.status_code == 200, reply.text
    # Text output, OpenAI's default modality, may be asked for.
    reply = http.post(CHAT, json=with_(OK_CHAT, modalities=["text"]))
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_model_may_be_left_out(http, path: str) -> None:
    """One model is served: a body without ``model`` gets it (as llama-server does)."""
    body = dict(OK_CHAT if path == CHAT else OK_COMPLETION)
    del body["model"]
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == MODEL_ID


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"   ", b"[1, 2]", b'"text"', b"\xff\xfe\x00", b'{"a": NaN}', b"[" * 50000],
)
def test_malformed_bodies_are_400(http, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    assert_openai_error(http.post(CHAT, content=raw, headers=headers), 400, code="invalid_json")


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (
            COMPLETIONS,
            b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2, "stream": true}',
            "prompt[1]",
        ),
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\uD83Db"}]}', "messages[0].content"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["\\ud800"]}',
            "guided_choice[0]",
        ),
        ("/v1/embeddings", b'{"input": ["a", "\\ud800"]}', "input[1]"),
        ("/tokenize", b'{"prompt": "\\ud83d"}', "prompt"),
        ("/completion", b'{"prompt": "\\ud800", "n_predict": 2}', "prompt"),
    ],
)
def test_a_lone_surrogate_anywhere_is_400_naming_where(
    http, path: str, raw: bytes, param: str
) -> None:
    """A string holding half of a UTF-16 pair (only a JSON escape makes one) is text
    no tokenizer or grammar takes; a whole pair (an emoji) is fine."""
    headers = {"content-type": "application/json"}
    assert_openai_error(
        http.post(path, content=raw, headers=headers), 400, code="invalid_unicode", param=param
    )
    pair = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    reply = http.post(COMPLETIONS, content=pair, headers=headers)
    assert reply.status_code == 200, reply.text


def test_a_grammar_naming_an_undefined_rule_is_400(http) -> None:
    for grammar in ("root ::= foo", "root ::= foo bar"):
        body = with_(OK_CHAT, grammar=grammar)
        assert_openai_error(http.post(CHAT, json=body), 400)


def test_detokenize_refuses_unknown_fields(http) -> None:
    assert_openai_error(
        http.post("/detokenize", json={"tokens": [1], "bogus": 1}), 400, param="bogus"
    )
    assert http.post("/detokenize", json={"tokens": [1]}).status_code == 200


def test_unknown_model_is_404(http) -> None:
    response = http.post(COMPLETIONS, json=with_(OK_COMPLETION, model="gpt-4"))
    assert_openai_error(response, 404, code="model_not_found", param="model")
    assert_openai_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")


def test_unknown_route_404_and_wrong_method_405(http) -> None:
    assert_openai_error(http.post("/v1/images/generations", json={}), 404, code="not_found")
    assert_openai_error(http.post("/v1/embeddings", json={}), 400, param="input")
    assert_openai_error(http.get("/nothing/here"), 404)
    response = http.get(CHAT)
    assert_openai_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]


def test_prompt_longer_than_context_is_400(http, backend) -> None:
    prompt = [5] * backend.context_length
    response = http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=prompt))
    assert_openai_error(response, 400, code="context_length_exceeded", param="prompt")
    chat = with_(OK_CHAT, messages=[{"role": "user", "content": "word " * 600}])
    assert_openai_error(
        http.post(CHAT, json=chat), 400, code="context_length_exceeded", param="messages"
    )
    # The Responses API names its own field (its body has no "messages").
    response = http.post("/v1/responses", json={"model": MODEL_ID, "input": "word " * 600})
    assert_openai_error(response, 400, code="context_length_exceeded", param="input")


def test_max_tokens_beyond_context_is_clamped(http, backend) -> None:
    prompt = [5] * (backend.context_length - 3)
    body = with_(OK_COMPLETION, prompt=prompt, max_tokens=100, temperature=0)
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert backend.requests[-1].max_new_tokens == 3
    assert reply["usage"]["completion_tokens"] <= 3
    if reply["usage"]["completion_tokens"] == 3:
        assert reply["choices"][0]["finish_reason"] == "length"


def test_body_over_the_limit_is_413(http) -> None:
    big = with_(OK_COMPLETION, prompt="x" * (BODY_LIMIT + 10))
    assert_openai_error(http.post(COMPLETIONS, json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    response = http.post(COMPLETIONS, content=chunked())
    assert_openai_error(response, 413, code="request_too_large")


def test_capacity_exceeded_is_429_with_retry_after(http, backend, base_url) -> None:
    backend.max_sessions = 0
    response = http.post(CHAT, json=OK_CHAT)
    assert_openai_error(response, 429)
    assert response.headers["retry-after"] == "1"
    stream = http.post(CHAT, json=with_(OK_CHAT, stream=True))
    assert_openai_error(stream, 429)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL_ID, messages=OK_CHAT["messages"])


def test_not_ready_is_503_with_reason(http, backend) -> None:
    backend.set_ready(False, "stage 1 is loading layers [2, 4)")
    health = http.get("/health")
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    assert health.json() == {"status": "unavailable", "reason": "stage 1 is loading layers [2, 4)"}
    response = http.post(COMPLETIONS, json=OK_COMPLETION)
    error = assert_openai_error(response, 503)
    assert "stage 1 is loading" in error["message"] and response.headers["retry-after"] == "1"


def test_a_request_during_a_reload_is_served_once_the_pipeline_is_back(http, backend) -> None:
    """While a pipeline that served is reloaded (a stage lost, a new plan), /health
    says so, and a request waits for the new pipeline instead of failing."""
    backend.set_ready(False, "reloading after a stage was lost")
    backend.reload_wait_s = 20.0
    assert http.get("/health").status_code == 503
    timer = threading.Timer(0.5, backend.set_ready, (True,))
    timer.start()
    started = time.monotonic()
    try:
        response = http.post(COMPLETIONS, json=OK_COMPLETION)
    finally:
        timer.cancel()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert time.monotonic() - started >= 0.4


def test_requests_waiting_for_the_pipeline_count_against_the_request_limit(
    http, base_url, backend
) -> None:
    """While no pipeline answers, requests wait for it (up to the recovery timeout):
    past the backend's capacity (running, queued and waiting together) the next one
    gets 429 at once instead of holding its connection for the whole wait."""
    backend.set_ready(False, "reloading after a stage was lost")
    backend.reload_wait_s = 60.0
    backend.request_capacity = 3
    backend.active_requests = 1
    results: list[int] = []

    def post() -> None:
        with httpx.Client(base_url=base_url, timeout=30.0) as client:
            results.append(client.post(COMPLETIONS, json=OK_COMPLETION).status_code)

    waiting = [threading.Thread(target=post) for _ in range(2)]
    try:
        for thread in waiting:
            thread.start()
        deadline = time.monotonic() + 30
        while backend.waiting < 2:
            assert time.monotonic() < deadline and not results, results
            time.sleep(0.02)
        # Without the limit it would wait the 60 s too, then get 503.
        error = assert_openai_error(http.post(CHAT, json=OK_CHAT), 429)
        assert "waiting for the pipeline" in error["message"]
        backend.set_ready(True)
        for thread in waiting:
            thread.join(30)
        assert results == [200, 200]
    finally:
        backend.set_ready(True)
        del backend.request_capacity, backend.active_requests


def test_a_reload_that_outlasts_the_wait_is_503(http, backend) -> None:
    backend.set_ready(False, "reloading after a stage was lost")
    backend.reload_wait_s = 0.3
    response = http.post(CHAT, json=with_(OK_CHAT, stream=True))
    error = assert_openai_error(response, 503)
    assert "reloading after a stage was lost" in error["message"]


def test_backend_unavailable_is_503(http, backend) -> None:
    backend.fail_with = Unavailable("stage 2 at 127.0.0.1:7001 is gone; replanning")
    response = http.post(COMPLETIONS, json=with_(OK_COMPLETION, stream=True))
    assert_openai_error(response, 503)
    assert response.headers["retry-after"] == "1"


def test_api_key_is_required_when_configured(backend, tokenizer) -> None:
    with live_server(backend, tokenizer, api_key="s3cret") as url:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            response = httpx.post(f"{url}{COMPLETIONS}", json=OK_COMPLETION, headers=headers)
            assert_openai_error(response, 401, code="invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
        assert httpx.get(f"{url}/health").status_code == 200
        good = {"authorization": "Bearer s3cret"}
        response = httpx.post(f"{url}{COMPLETIONS}", json=OK_COMPLETION, headers=good, timeout=30)
        assert response.status_code == 200, response.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list().data
        # Anthropic clients send the key as x-api-key, and get Anthropic's error shape.
        import anthropic

        ask = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0).messages.create(**ask)
        assert caught.value.body["error"]["type"] == "authentication_error"
        reply = anthropic.Anthropic(base_url=url, api_key="s3cret").messages.create(**ask)
        assert reply.type == "message" and reply.usage.output_tokens == 2


def test_each_key_of_a_key_file_names_its_tenant(backend, tokenizer, tmp_path) -> None:
    """Several keys: each is let in as its tenant, which reaches the engine (the
    prefix cache's partition and the drafter's scope) and /metrics; others get 401."""
    from mesh.api_keys import KeySource

    path = tmp_path / "keys"
    path.write_text("alice key-of-alice\nbob key-of-bob\n")
    metrics = FrontendMetrics()
    with live_server(backend, tokenizer, api_key=KeySource(path=path), metrics=metrics) as url:
        for key, user, tenant, scope in (
            ("key-of-alice", None, "alice", "alice/"),
            ("key-of-bob", "u1", "bob", "bob/u1"),
        ):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            extra = {"user": user} if user else {}
            client.completions.create(model=MODEL_ID, prompt="hello", max_tokens=3, **extra)
            request = backend.requests[-1]
            assert (request.tenant, request.scope) == (tenant, scope)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0).models.list()
        scrape = httpx.get(f"{url}/metrics").text
        for tenant in ("alice", "bob"):
            assert f'mesh_tenant_tokens_total{{kind="completion",tenant="{tenant}"}} 3.0' in scrape
            assert f'mesh_tenant_tokens_total{{kind="prompt",tenant="{tenant}"}}' in scrape


def test_a_keys_max_concurrent_holds_its_tenant_alone(backend, tokenizer, tmp_path) -> None:
    """alice may run one generation at a time: her second is a 429 while the first
    streams, n=2 is a 400, bob is not held; once her stream ends she may go again."""
    from mesh.api_keys import KeySource

    path = tmp_path / "keys"
    path.write_text("alice key-of-alice max_concurrent=1\nbob key-of-bob\n")
    backend.step_delay_s = 0.02
    try:
        with live_server(backend, tokenizer, api_key=KeySource(path=path)) as url:
            alice = {"authorization": "Bearer key-of-alice"}
            bob = {"authorization": "Bearer key-of-bob"}
            long = with_(OK_COMPLETION, max_tokens=60, stream=True)
            with httpx.Client(base_url=url, timeout=30.0) as client:
                with client.stream("POST", COMPLETIONS, json=long, headers=alice) as first:
                    assert first.status_code == 200
                    lines = first.iter_lines()
                    assert next(line for line in lines if line.startswith("data: {"))
                    gauge = 'mesh_tenant_running_generations{tenant="alice"} 1.0'
                    assert gauge in client.get("/metrics").text
                    second = client.post(COMPLETIONS, json=OK_COMPLETION, headers=alice)
                    assert_openai_error(second, 429)
                    assert "limit is 1" in second.json()["error"]["message"]
                    assert client.post(COMPLETIONS, json=OK_COMPLETION, headers=bob).is_success
                    for _ in lines:
                        pass
                many = client.post(COMPLETIONS, json=with_(OK_COMPLETION, n=2), headers=alice)
                assert_openai_error(many, 400, param="n")
                again = client.post(COMPLETIONS, json=OK_COMPLETION, headers=alice)
                assert again.status_code == 200, again.text
                scrape = client.get("/metrics").text
                assert 'mesh_tenant_running_generations{tenant="alice"} 0.0' in scrape
    finally:
        backend.step_delay_s = 0.0


def test_without_keys_the_scope_is_the_user(http, backend) -> None:
    response = http.post(COMPLETIONS, json=with_(OK_COMPLETION, user="carol"))
    assert response.status_code == 200, response.text
    assert (backend.requests[-1].tenant, backend.requests[-1].scope) == ("", "carol")


def test_disconnect_mid_stream_cancels_the_request(http, backend, base_url) -> None:
    backend.step_delay_s = 0.02
    closed_before = len(backend.closed.ids)
    body = with_(OK_COMPLETION, max_tokens=400, stream=True)
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        with client.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            data: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line)
                if len(data) >= 3:
                    break
    request_id = backend.requests[-1].request_id
    closed = backend.closed.wait_for(closed_before + 1, timeout_s=5.0)
    assert request_id in closed, "the backend did not see the request closed"
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "mesh_active_requests") == 0
    tokens = metric_value(metrics, "mesh_completion_tokens_total", 'endpoint="/v1/completions"')
    assert tokens < 400 * 2  # the 400-token request stopped early


def test_disconnect_during_non_streaming_request_cancels_it(http, backend, base_url) -> None:
    backend.step_delay_s = 0.02
    closed_before = len(backend.closed.ids)
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(with_(OK_COMPLETION, max_tokens=400)).encode()
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        wait = backend.closed.wait_for(closed_before + 1, timeout_s=0.3)
        assert len(wait) == closed_before, "the request finished before the client left"
    closed = backend.closed.wait_for(closed_before + 1, timeout_s=5.0)
    assert backend.requests[-1].request_id in closed
    # The answer (499) is counted once the handler returns, just after it freed the
    # request.
    deadline = time.monotonic() + 5.0
    while True:
        metrics = http.get("/metrics").text
        label = f'endpoint="{COMPLETIONS}",status="499"'
        if metric_value(metrics, "mesh_http_requests_total", label) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric_value(metrics, "mesh_http_requests_total", label)


def test_a_client_leaving_a_gathered_answer_is_a_disconnect_not_an_error() -> None:
    """A non-streaming answer waits on ``asyncio.gather`` of its choices; a cancelled
    gather ends with a CancelledError result rather than cancelled, which once escaped
    as an unhandled error (a traceback in the log) instead of a 499."""

    async def scenario() -> tuple[list[int], bool]:
        messages: asyncio.Queue = asyncio.Queue()
        stopped: list[str] = []

        async def choice(name: str) -> int:
            try:
                await asyncio.sleep(60)
            finally:
                stopped.append(name)
            return 0

        async def quick() -> int:
            return 7

        done = await until_disconnect(messages.get, asyncio.gather(quick(), quick()))
        waiting = asyncio.ensure_future(
            until_disconnect(messages.get, asyncio.gather(choice("a"), choice("b")))
        )
        await asyncio.sleep(0.01)
        await messages.put({"type": "http.disconnect"})
        try:
            await waiting
        except ClientDisconnected:
            return done, sorted(stopped) == ["a", "b"]
        raise AssertionError("no ClientDisconnected")

    unhandled: list[dict] = []

    def run() -> tuple[list[int], bool]:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        try:
            return loop.run_until_complete(scenario())
        finally:
            loop.close()

    done, both_stopped = run()
    gc.collect()  # a future whose exception nobody read reports it when collected
    assert done == [7, 7] and both_stopped
    assert not unhandled, unhandled


def test_client_leaving_during_the_body_upload_is_not_a_server_error(http, base_url) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 5000\r\n\r\n"
    ).encode()
    before = metric_value(
        http.get("/metrics").text,
        "mesh_http_requests_total",
        f'endpoint="{COMPLETIONS}",status="499"',
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b'{"model": "tiny')
    labels = f'endpoint="{COMPLETIONS}",status="499"'
    deadline = time.monotonic() + 5.0
    while metric_value(http.get("/metrics").text, "mesh_http_requests_total", labels) == before:
        assert time.monotonic() < deadline, "the aborted upload was never accounted for"
        time.sleep(0.02)


def test_cors_origins_are_allowed(backend, tokenizer) -> None:
    origin = "http://ui.example"
    with live_server(backend, tokenizer, cors_origins=[origin]) as url:
        preflight = httpx.options(
            f"{url}{CHAT}",
            headers={"origin": origin, "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        response = httpx.get(f"{url}/v1/models", headers={"origin": origin})
        assert response.headers["access-control-allow-origin"] == origin
        other = httpx.get(f"{url}/v1/models", headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_fastapi_validation_errors_are_openai_400s(backend, tokenizer) -> None:
    from fastapi.testclient import TestClient

    from stage.frontend.app import create_app

    app = create_app(backend, tokenizer, model_id=MODEL_ID)

    @app.get("/typed")
    async def typed(count: int) -> dict:
        return {"count": count}

    with TestClient(app) as client:
        assert client.get("/typed", params={"count": 3}).json() == {"count": 3}
        assert_openai_error(client.get("/typed", params={"count": "x"}), 400, param="count")
        assert_openai_error(client.get("/typed"), 400, code="missing_field", param="count")


def test_an_empty_prompt_of_a_batch_is_named(http) -> None:
    error = assert_openai_error(
        http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=[[1, 2], [3], []])), 400
    )
    assert "prompt 2 is empty" in error["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
USER = {"role": "user", "content": "go"}


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "r"}], "not an assistant"),
        (
            [
                USER,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_9", "content": "r"},
            ],
            "'call_9'",
        ),
        ([USER, {"role": "assistant", "tool_calls": [CALL]}, USER], "no 'tool' message answers"),
        ([USER, {"role": "assistant", "tool_calls": [CALL, CALL]}], "two tool calls with one id"),
        ([USER, {"role": "assistant", "tool_calls": [CALL]}], "conversation ends before"),
    ],
)
def test_tool_results_that_answer_no_call_are_400(http, messages: list, says: str) -> None:
    """As OpenAI checks them: results answer the calls before them, by id, and every
    call is answered before the conversation goes on."""
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 2}
    error = assert_openai_error(http.post(CHAT, json=body), 400, param="messages")
    assert says in error["message"]


def test_sound_tool_conversations_pass_the_check(http) -> None:
    nameless = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversations = [
        # Two calls answered in either order, then the user goes on.
        [
            USER,
            {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "b"},
            {"role": "tool", "tool_call_id": "call_1", "content": "a"},
            {"role": "assistant", "content": "done"},
            USER,
        ],
        # Calls sent back without ids: their results need only follow them.
        [
            USER,
            {"role": "assistant", "tool_calls": [nameless]},
            {"role": "tool", "tool_call_id": "x", "content": "r"},
        ],
        # The last message calls: the answer comes next.
        [
            USER,
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "r"},
        ],
    ]
    for messages in conversations:
        reply = http.post(CHAT, json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
        assert reply.status_code == 200, reply.text


def test_responses_and_anthropic_results_answer_calls_too(http) -> None:
    orphan = [
        {"role": "user", "content": "go"},
        {"type": "function_call_output", "call_id": "call_7", "output": "r"},
    ]
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    reply = http.post("/v1/responses", json={"input": orphan, "tools": tools})
    assert assert_openai_error(reply, 400, param="input")
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "r"}],
        },
    ]
    anthropic = http.post(
        "/v1/messages",
        json={
            "max_tokens": 2,
            "messages": messages,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        },
    )
    assert anthropic.status_code == 400, anthropic.text
    assert "toolu_2" in anthropic.text


def test_a_completion_without_max_tokens_gets_openais_default_of_16(http, backend) -> None:
    body = {key: value for key, value in OK_COMPLETION.items() if key != "max_tokens"}
    reply = http.post(COMPLETIONS, json=body)
    assert reply.status_code == 200, reply.text
    assert backend.requests[-1].max_new_tokens == 16
    assert reply.json()["usage"]["completion_tokens"] <= 16
    # Chat keeps the room left in the context (the stream is left at its start).
    with http.stream("POST", CHAT, json={"model": MODEL_ID, "messages": [USER], "stream": True}):
        pass
    assert backend.requests[-1].max_new_tokens > 16


def test_an_assistant_refusal_part_sent_back_is_read_as_its_text(http, backend) -> None:
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    body = {"model": MODEL_ID, "messages": [USER, refused, USER], "max_tokens": 2}
    reply = http.post(CHAT, json=body)
    assert reply.status_code == 200, reply.text
    # Only the assistant's own turn may hold one.
    user_refusal = {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}
    error = assert_openai_error(
        http.post(CHAT, json={**body, "messages": [user_refusal]}), 400, param="messages"
    )
    assert "refusal" in error["message"]


def test_top_p_0_keeps_the_likeliest_token_alone(http, backend) -> None:
    """OpenAI takes top_p 0; it samples as the least positive top_p, which only the
    likeliest token passes."""
    reply = http.post(CHAT, json=with_(OK_CHAT, top_p=0, temperature=1.0, seed=3))
    assert reply.status_code == 200, reply.text
    assert 0 < backend.requests[-1].sampling.top_p <= 1e-6


def test_every_response_carries_an_x_request_id(http, base_url) -> None:
    """OpenAI's clients read ``x-request-id`` as the request's id (``_request_id``,
    and on their errors): a new one per response, or the client's own."""
    from openai import OpenAI

    first, second = http.post(CHAT, json=OK_CHAT), http.get("/v1/nothing")
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert all(i.startswith("req_") for i in ids) and ids[0] != ids[1]
    own = http.post(CHAT, json=OK_CHAT, headers={"x-request-id": "trace-42"})
    assert own.headers["x-request-id"] == "trace-42"
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    assert client.chat.completions.create(**OK_CHAT)._request_id.startswith("req_")


def test_stream_options_include_obfuscation_is_taken(http) -> None:
    body = with_(OK_CHAT, stream=True, stream_options={"include_obfuscation": False})
    with http.stream("POST", CHAT, json=body) as reply:
        assert reply.status_code == 200


def test_tokens_the_tokenizer_has_and_the_model_does_not_are_400(http, backend) -> None:
    """A tokenizer larger than the model's vocabulary (added tokens without embedding
    rows): a prompt, explicit or typed as text, holding such a token, a stop token id
    or a logit_bias key beyond the model's rows gets a 400 naming the model's bound
    (before: the tokenizer's bound, an opaque stage error, or a bias silently
    dropped)."""
    backend.vocab_size = 100  # the model's rows; the tokenizer has 49152
    try:
        text = http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt="hello world"))
        assert_openai_error(text, 400, param="prompt")
        assert "outside the model's vocabulary [0, 100)" in text.json()["error"]["message"]
        ids = http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=[5, 150]))
        assert_openai_error(ids, 400, param="prompt")
        chat = http.post(CHAT, json=OK_CHAT)
        assert_openai_error(chat, 400, param="messages")
        biased = with_(OK_COMPLETION, prompt=[5, 6], logit_bias={"200": 5})
        assert_openai_error(http.post(COMPLETIONS, json=biased), 400, param="logit_bias")
        embedded = http.post("/v1/embeddings", json={"model": MODEL_ID, "input": "hello"})
        assert_openai_error(embedded, 400, param="input")
        fine = http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=[5, 6]))
        assert fine.status_code == 200, fine.text
    finally:
        del backend.vocab_size


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(
    http, backend, tokenizer, monkeypatch
) -> None:
    """Text with more characters than the context holds tokens of the longest token
    the vocabulary has is refused at once, without tokenizing it (a few MB of text
    would otherwise be tokenized whole first: memory and seconds per request)."""
    from stage.frontend.prepare import longest_token_chars

    longest = longest_token_chars(tokenizer)
    text = "a" * (longest * backend.context_length + longest)
    assert len(text) < BODY_LIMIT - 1024
    calls: list[str] = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(type(tokenizer), name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(type(tokenizer), name, counting)
    chat = with_(OK_CHAT, messages=[{"role": "user", "content": text}])
    body = assert_openai_error(
        http.post(CHAT, json=chat), 400, code="context_length_exceeded", param="messages"
    )
    assert "characters, so at least" in body["message"]
    response = http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=text))
    body = assert_openai_error(response, 400, code="context_length_exceeded", param="prompt")
    assert "characters, so at least" in body["message"]
    response = http.post("/completion", json={"prompt": text, "n_predict": 2})
    body = assert_openai_error(response, 400, code="context_length_exceeded", param="prompt")
    response = http.post("/v1/embeddings", json={"model": MODEL_ID, "input": ["hi", text]})
    body = assert_openai_error(response, 400, code="context_length_exceeded", param="input")
    assert body["message"].startswith("input 1 has")
    assert not calls
    # Text that may fit is tokenized and judged by its real count.
    fits = "word " * 20
    assert http.post(COMPLETIONS, json=with_(OK_COMPLETION, prompt=fits)).status_code == 200
    assert "encode" in calls


def test_a_body_that_stalls_or_trickles_gets_408_and_its_connection_closed(
    base_url, http, monkeypatch
) -> None:
    """Headers sent, then the body stops (or comes a byte at a time): the request is
    answered 408 once the body falls behind its minimum rate, the connection closes,
    and the server goes on serving."""
    from urllib.parse import urlsplit

    from stage.frontend import http_server

    monkeypatch.setattr(http_server, "REQUEST_BODY_GRACE_S", 1.0)
    where = urlsplit(base_url)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    for trickle in (False, True):
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(head + b'{"messages":')
            sock.settimeout(0.3)
            answer = b""
            deadline = time.monotonic() + 20
            ended = False
            while time.monotonic() < deadline:
                try:
                    if trickle and not answer:
                        sock.sendall(b" ")
                    piece = sock.recv(65536)
                except TimeoutError:
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    # A byte sent after the server closed: the kernel resets the
                    # connection and may drop the answer not yet read.
                    ended = True
                    break
                if not piece:
                    ended = True
                    break
                answer += piece
        assert ended
        if trickle and not answer:
            continue  # closed on the trickler, its 408 lost to the reset
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer[:200]
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_timeout"
        assert "arrived too slowly" in body["error"]["message"]
    assert http.post(CHAT, json=OK_CHAT).status_code == 200
