"""Property: no request body, however malformed, makes the server answer 5xx.

Random JSON documents, valid bodies with fields replaced by random values, and
raw bytes go to both generation endpoints of a live server over a tiny real
model; every answer is a 2xx with a well-formed body or a 4xx OpenAI error. With
a ready backend below its session limit, 429 and 503 cannot happen either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from frontend_support import MODEL_ID, TinyModelBackend, assert_openai_error, live_server
from fuzz_support import json_values as fuzz_json_values
from fuzz_support import token_budget
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stage.frontend.prepare import FrontendLimits

PATHS = ("/v1/chat/completions", "/v1/completions")
BASE = {
    "/v1/chat/completions": {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2},
}
FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "user",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)

json_values = fuzz_json_values([0, 1, 2, 4, -1, 0.5, 2**31, 2**64, "", MODEL_ID, "user", "text"])
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "x"]),
            "content": st.one_of(
                st.text(max_size=30),
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})),
                json_values,
            ),
        }
    ),
    max_size=4,
)
token_ids = st.lists(st.integers(min_value=-3, max_value=60000), max_size=6)


def field_values(name: str):
    """Random values, weighted toward ones close to valid for this field."""
    special = {
        "messages": messages,
        "prompt": st.one_of(st.text(max_size=30), token_ids, st.lists(token_ids, max_size=2)),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6)),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values})),
        # Budgets stay tiny (or invalid) so valid bodies finish fast.
        "max_tokens": st.one_of(st.integers(min_value=-3, max_value=3), json_values),
        "max_completion_tokens": st.one_of(st.integers(min_value=-3, max_value=3), json_values),
        "stream": st.booleans(),
    }
    strategy = special.get(name)
    return json_values if strategy is None else st.one_of(strategy, json_values)


@st.composite
def requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(json_values)).encode()
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(field_values(name))
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module")
def http(tiny_model_factory) -> Iterator[httpx.Client]:
    from transformers import AutoTokenizer

    model_dir = Path(tiny_model_factory("llama", layers=2))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = TinyModelBackend(model_dir)
    limits = FrontendLimits(default_max_tokens=3)
    with live_server(backend, tokenizer, limits=limits) as url:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            yield client


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_no_body_produces_a_server_error(http: httpx.Client, request: tuple[str, bytes]) -> None:
    path, raw = request
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        reply = response.json()
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        # At most the body's budget (else the default, 3) per choice.
        budget = token_budget(raw, ["max_tokens", "max_completion_tokens"], 3)
        assert reply["usage"]["completion_tokens"] <= budget * len(reply["choices"])
