"""Property: no body sent to llama.cpp's routes (``/completion``, ``/infill``,
``/apply-template``) or to ``/v1/completions`` with a ``suffix`` makes the server
answer 5xx: random JSON, valid bodies with fields replaced by random values, and
raw bytes, against a live server over a tiny real model with fill-in-the-middle
tokens. Every answer is a 2xx in the route's shape or a 4xx OpenAI error."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from frontend_support import MODEL_ID, TinyModelBackend, assert_openai_error, live_server
from fuzz_support import json_values as fuzz_json_values
from fuzz_support import token_budget
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from stage.frontend.prepare import FrontendLimits

BASE = {
    "/completion": {"prompt": "def f(x):", "n_predict": 2},
    "/infill": {"input_prefix": "def f(x):\n", "input_suffix": "\nprint(f(1))\n", "n_predict": 2},
    "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL_ID, "prompt": "def f(x):", "suffix": "\n", "max_tokens": 2},
}
FIELDS = (
    "prompt",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "suffix",
    "n_predict",
    "max_tokens",
    "n_indent",
    "t_max_predict_ms",
    "temperature",
    "top_k",
    "seed",
    "stream",
    "repeat_penalty",
    "repeat_last_n",
    "mirostat",
    "typical_p",
    "dry_multiplier",
    "cache_prompt",
    "samplers",
    "n",
    "echo",
    "messages",
)

json_values = fuzz_json_values([0, 1, 2, -1, 0.5, 1.0, 2**31, "", "\n", "    ", MODEL_ID])
files = st.lists(
    st.fixed_dictionaries(
        {"filename": st.one_of(st.text(max_size=8), json_values), "text": st.text(max_size=40)}
    ),
    max_size=3,
)


def field_values(name: str):
    special = {
        "input_extra": files,
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 60000), max_size=6)),
        "n_predict": st.integers(min_value=-3, max_value=3),
        "max_tokens": st.integers(min_value=-3, max_value=3),
        "n_indent": st.integers(min_value=-1, max_value=8),
        "stream": st.booleans(),
    }
    strategy = special.get(name)
    return json_values if strategy is None else st.one_of(strategy, json_values)


@st.composite
def requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BASE)))
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
def http(fim_model_dir) -> Iterator[httpx.Client]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fim_model_dir)
    backend = TinyModelBackend(fim_model_dir)
    with live_server(backend, tokenizer, limits=FrontendLimits(default_max_tokens=3)) as url:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            yield client


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
# A completion without max_tokens takes the operator's default (3 here) before
# OpenAI's 16.
@example(
    request=(
        "/v1/completions",
        json.dumps({**BASE["/v1/completions"], "max_tokens": None}).encode(),
    )
)
def test_no_body_produces_a_server_error(http: httpx.Client, request: tuple[str, bytes]) -> None:
    path, raw = request
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    event(f"{path} {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        if path == "/v1/completions":
            assert events[-1] == "data: [DONE]", response.text
        else:
            assert json.loads(events[-1][6:])["stop"] is True, response.text
    elif path == "/apply-template":
        assert isinstance(response.json()["prompt"], str)
    elif path == "/v1/completions":
        budget = token_budget(raw, ["max_tokens"], 3)
        assert response.json()["usage"]["completion_tokens"] <= budget * len(
            response.json()["choices"]
        )
    else:
        answer = response.json()
        budget = token_budget(raw, ["n_predict", "max_tokens"], 3)
        assert answer["stop"] is True and answer["tokens_predicted"] <= budget, answer
