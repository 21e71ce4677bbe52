"""The HTTP layer's series over a real uvicorn server, a real tiny model and the
openai client: every request is counted however it ends (the token budget, a stop
string, an error, a client that leaves a stream: 499, not 200), tokens are counted
while they stream, and the series are in base units."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, TinyModelBackend, live_server
from metrics_support import naming_problems, value

from mesh.errors import Unavailable
from stage.frontend.backend import TokenEvent

COMPLETIONS = "/v1/completions"
PROMPT = "The history of the river"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_factory("llama", layers=2))


@pytest.fixture(scope="module")
def backend(tiny_model_factory) -> TinyModelBackend:
    return TinyModelBackend(Path(tiny_model_factory("llama", layers=2)))


@pytest.fixture(scope="module")
def base_url(backend, tokenizer):
    with live_server(backend, tokenizer) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def wait_until(condition, what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_budget_and_stop_string_endings_are_counted(client, base_url) -> None:
    before = scrape(base_url)
    whole = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0)
    text = whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    starts = [i for i in range(3, len(text) - 2) if not text[i : i + 2].isspace()]
    assert starts, f"the greedy text needs visible characters: {text!r}"
    stop = text[starts[0] : starts[0] + 2]
    cut = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    after = scrape(base_url)
    assert naming_problems(after) == []

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ends = {"endpoint": COMPLETIONS}
    assert grew("mesh_generations_total", reason="length", **ends) == 1
    assert grew("mesh_generations_total", reason="stop_string", **ends) == 1
    assert grew("mesh_http_requests_total", status="200", **ends) == 2
    assert grew("mesh_completion_tokens_total", **ends) == 12 + cut.usage.completion_tokens
    assert grew("mesh_time_to_first_token_seconds_count", **ends) == 2
    # Per-token latency needs two tokens; the stop string may come with the first.
    per_token = 1 + (cut.usage.completion_tokens >= 2)
    assert grew("mesh_time_per_output_token_seconds_count", **ends) == per_token
    # Seconds: the tiny model answers well within a minute, and takes some time.
    assert 0 < grew("mesh_http_request_duration_seconds_sum", **ends) < 60


def test_a_stream_the_client_leaves_is_a_499_and_its_tokens_count(backend, base_url) -> None:
    backend.step_delay_s = 0.02
    before = scrape(base_url)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    try:
        with httpx.Client(base_url=base_url, timeout=30.0) as http:
            with http.stream("POST", COMPLETIONS, json=body) as response:
                assert response.status_code == 200
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 4:
                        # Tokens count as they stream, not when the request ends.
                        during = scrape(base_url)
                        break  # closes the stream: the client leaves
    finally:
        backend.step_delay_s = 0.0

    def counted(name: str, **labels: str) -> float:
        return value(scrape(base_url), name, **labels) - value(before, name, **labels)

    streamed = value(during, "mesh_completion_tokens_total", endpoint=COMPLETIONS)
    assert streamed - value(before, "mesh_completion_tokens_total", endpoint=COMPLETIONS) >= 4
    assert value(during, "mesh_http_requests_in_flight", endpoint=COMPLETIONS) == 1
    assert value(during, "mesh_active_requests") == 1
    wait_until(
        lambda: counted("mesh_http_requests_total", endpoint=COMPLETIONS, status="499") == 1,
        "the abandoned stream to be counted as 499",
    )
    after = scrape(base_url)
    assert value(after, "mesh_http_requests_total", endpoint=COMPLETIONS, status="200") == value(
        before, "mesh_http_requests_total", endpoint=COMPLETIONS, status="200"
    )
    assert counted("mesh_generations_total", endpoint=COMPLETIONS, reason="cancelled") == 1
    assert value(after, "mesh_active_requests") == 0
    assert value(after, "mesh_http_requests_in_flight", endpoint=COMPLETIONS) == 0
    assert backend.active_count == 0


def test_an_error_mid_stream_ends_the_generation_as_an_error(tokenizer) -> None:
    events = [TokenEvent((5,)), TokenEvent((6,)), Unavailable("stage 1 was lost; retry")]
    with live_server(ScriptedBackend(events), tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=MODEL_ID, prompt=PROMPT, stream=True)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        text = scrape(url)
    assert value(text, "mesh_generations_total", endpoint=COMPLETIONS, reason="error") == 1
    assert value(text, "mesh_completion_tokens_total", endpoint=COMPLETIONS) == 2
    # The stream itself ended properly (with an error event): 200.
    assert value(text, "mesh_http_requests_total", endpoint=COMPLETIONS, status="200") == 1


def test_a_request_refused_before_it_started_is_not_a_generation(tokenizer) -> None:
    """A full queue's 429: nothing was generated, so mesh_generations_total does not
    count an "error" (an alert on generation errors fired on ordinary back-pressure);
    mesh_http_requests_total counts the 429."""
    from mesh.errors import CapacityExceeded

    refused = ScriptedBackend([CapacityExceeded("16 requests in flight and 32 queued")])
    with live_server(refused, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2)
        text = scrape(url)
    assert value(text, "mesh_generations_total", endpoint=COMPLETIONS) == 0
    assert value(text, "mesh_http_requests_total", endpoint=COMPLETIONS, status="429") == 1
