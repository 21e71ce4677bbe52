"""Property: no request body, however malformed, makes ``POST /v1/responses`` answer
5xx. Valid bodies with fields replaced by random values (close to valid ones
often), random JSON and raw bytes go to a live server over a tiny real model;
every answer is a response (status ``completed`` or ``incomplete``), a stream that
ends with one, or a 4xx OpenAI error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from frontend_support import MODEL_ID, TinyModelBackend, assert_openai_error, live_server
from fuzz_support import json_values as fuzz_json_values
from fuzz_support import token_budget
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from stage.frontend.prepare import FrontendLimits

PATH = "/v1/responses"
BASE = {"model": MODEL_ID, "input": "hi", "max_output_tokens": 2}
FIELDS = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "user",
    "seed",
    "truncation",
    "reasoning",
    "include",
    "previous_response_id",
    "metadata",
)

json_values = fuzz_json_values([0, 1, 2, -1, 0.5, 2**31, "", MODEL_ID, "auto", "none", "function"])
parts = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["input_text", "output_text", "input_image", "text"]),
            "text": st.one_of(st.text(max_size=20), json_values),
        }
    ),
    max_size=3,
)
items = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                "content": st.one_of(st.text(max_size=20), parts, json_values),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": st.text(max_size=8),
                "name": st.sampled_from(["get_weather", "", "bad name"]),
                "arguments": st.one_of(st.just('{"city": "Oslo"}'), st.text(max_size=8)),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call_output"),
                "call_id": st.text(max_size=8),
                "output": st.one_of(st.text(max_size=20), parts),
            }
        ),
        json_values,
    ),
    max_size=4,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "web_search"]),
            "name": st.sampled_from(["get_weather", "get_time", "x y"]),
            "parameters": st.one_of(st.just({"type": "object"}), json_values),
        }
    ),
    max_size=2,
)
formats = st.fixed_dictionaries(
    {
        "format": st.fixed_dictionaries(
            {
                "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
                "name": st.sampled_from(["answer", "bad name"]),
                "schema": st.one_of(st.just({"type": "object"}), json_values),
            }
        )
    }
)


def field_values(name: str):
    """Random values, weighted toward ones close to valid for this field."""
    special = {
        "input": st.one_of(st.text(max_size=30), items),
        "tools": tools,
        "text": formats,
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": st.just("get_weather")}),
        ),
        # Budgets stay tiny (or invalid) so valid bodies finish fast.
        "max_output_tokens": st.integers(min_value=-3, max_value=3),
        "stream": st.booleans(),
    }
    strategy = special.get(name)
    return json_values if strategy is None else st.one_of(strategy, json_values)


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body = dict(BASE)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(field_values(name))
    return json.dumps(body).encode()


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
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=bodies())
# A budget above the server's default (found by this test).
@example(raw=b'{"model": "tiny-llama", "input": "hi", "max_output_tokens": 4}')
def test_no_body_produces_a_server_error(http: httpx.Client, raw: bytes) -> None:
    response = http.post(PATH, content=raw, headers={"content-type": "application/json"})
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        last = response.text.rstrip().rpartition("\ndata: ")[2]
        reply = json.loads(last)["response"]
    else:
        reply = response.json()
    assert reply["object"] == "response"
    assert reply["status"] in ("completed", "incomplete")
    assert reply["usage"]["output_tokens"] <= token_budget(raw, ["max_output_tokens"], 3)
