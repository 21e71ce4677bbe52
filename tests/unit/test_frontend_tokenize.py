"""``POST /tokenize`` and ``POST /detokenize`` on a live server: the served model's
tokenizer in vLLM's shapes (and llama.cpp's key names), the chat template as chat
requests use it, and 400s in OpenAI's shape for bad input."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from frontend_support import MODEL_ID, assert_openai_error, live_server


@pytest.fixture(scope="module")
def http(backend, tokenizer) -> Iterator[httpx.Client]:
    with live_server(backend, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def test_tokenize_and_detokenize_round_trip(http, tokenizer, backend) -> None:
    text = "Naïve café — 日本語 and code: def f(x): return x"
    reply = http.post("/tokenize", json={"model": MODEL_ID, "prompt": text})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == backend.context_length
    # llama.cpp's names for the same request and answer.
    again = http.post("/tokenize", json={"content": text, "add_special": False}).json()
    assert again["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == back["content"] == tokenizer.decode(body["tokens"])


def test_chat_messages_are_counted_as_a_chat_request_reads_them(http, tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How long is the river?"},
    ]
    reply = http.post("/tokenize", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(want, list):  # newer transformers answer a BatchEncoding
        want = want["input_ids"]
    assert reply.json()["tokens"] == list(want)
    chat = http.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0}
    ).json()
    assert chat["usage"]["prompt_tokens"] == reply.json()["count"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "typo": 1}, "typo"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_that_names_the_parameter(http, path, body, param) -> None:
    reply = http.post(path, json=body)
    assert_openai_error(reply, 400, param=param)
