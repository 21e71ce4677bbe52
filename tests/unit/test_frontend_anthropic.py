"""Anthropic's Messages API with the official ``anthropic`` client against a real
uvicorn server over a real tiny model: ``/v1/messages`` streamed and not, and
``/v1/messages/count_tokens``, which counts the prompt ``/v1/messages`` reads."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from frontend_support import MODEL_ID

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
    },
]
COUNTED = [
    {"messages": ASK},
    {"messages": ASK, "system": "You are terse."},
    {"messages": ASK, "system": [{"type": "text", "text": "You are terse."}], "tools": [WEATHER]},
    {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"}},
    {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
    {"messages": ANSWERED, "tools": [WEATHER]},
]


@pytest.fixture(scope="module")
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("request_body", COUNTED)
def test_count_tokens_is_what_messages_reads(claude, backend, request_body: dict) -> None:
    counted = claude.messages.count_tokens(model=MODEL_ID, **request_body)
    reply = claude.messages.create(model=MODEL_ID, max_tokens=1, **request_body)
    assert counted.input_tokens == reply.usage.input_tokens
    assert counted.input_tokens == len(backend.requests[-1].prompt_tokens)


def test_count_tokens_needs_neither_model_nor_max_tokens_nor_the_pipeline(
    base_url, backend, claude
) -> None:
    expected = claude.messages.count_tokens(model=MODEL_ID, messages=ASK).input_tokens
    backend.set_ready(False, "loading layers")
    try:
        response = httpx.post(
            f"{base_url}/v1/messages/count_tokens", json={"messages": ASK}, timeout=30
        )
    finally:
        backend.set_ready(True)
    assert response.status_code == 200, response.text
    assert response.json() == {"input_tokens": expected}


def test_count_tokens_errors_have_anthropics_shape(claude, base_url) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.count_tokens(model="other-model", messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    for body in (
        {"model": MODEL_ID},
        {"model": MODEL_ID, "messages": ASK, "typo": 1},
        {"model": MODEL_ID, "messages": [{"role": "robot", "content": "x"}]},
        {"model": MODEL_ID, "messages": ASK, "tools": [{"type": "web_search_20250305"}]},
        # Nothing to answer: no message with a block of content.
        {"model": MODEL_ID, "messages": [{"role": "user", "content": []}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "thinking"}]}]},
    ):
        response = httpx.post(f"{base_url}/v1/messages/count_tokens", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
    refused = httpx.post(
        f"{base_url}/v1/messages/count_tokens",
        json={"model": MODEL_ID, "messages": ASK, "tools": [{"type": "web_search_20250305"}]},
        timeout=30,
    )
    assert "server tool 'web_search_20250305' is not supported" in refused.text
    # A client tool may say its type.
    custom = httpx.post(
        f"{base_url}/v1/messages/count_tokens",
        json={"model": MODEL_ID, "messages": ASK, "tools": [WEATHER | {"type": "custom"}]},
        timeout=30,
    )
    assert custom.status_code == 200, custom.text


def test_messages_without_content_are_400_not_500(base_url) -> None:
    for stream in (False, True):
        body = {
            "model": MODEL_ID,
            "max_tokens": 5,
            "stream": stream,
            "messages": [{"role": "user", "content": []}],
        }
        response = httpx.post(f"{base_url}/v1/messages", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert "no content to answer" in response.json()["error"]["message"]


def test_messages_stream_matches_the_message(claude) -> None:
    ask = {"model": MODEL_ID, "max_tokens": 6, "messages": ASK, "extra_body": {"temperature": 0.0}}
    reply = claude.messages.create(**ask)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 6
    with claude.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
