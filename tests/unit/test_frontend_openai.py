"""The OpenAI client against a real uvicorn server over a real tiny model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from frontend_support import MODEL_ID, TinyModelBackend, live_server, metric_value

MESSAGES = [{"role": "user", "content": "Write one short sentence about rivers."}]
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


def test_chat_completion_uses_the_chat_template(client, backend, tokenizer) -> None:
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=6, temperature=0
    )
    expected_prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert list(backend.requests[-1].prompt_tokens) == list(expected_prompt)
    assert backend.requests[-1].stop_token_ids == frozenset({tokenizer.eos_token_id})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL_ID
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected_prompt)
    assert reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == len(expected_prompt) + 6
    timings = reply.model_extra["timings"]
    assert timings["prompt_n"] == len(expected_prompt) and timings["predicted_n"] == 6
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
    assert "predicted_per_second" in timings


def test_chat_stream_matches_non_stream_and_reports_usage(client) -> None:
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.model_extra["timings"]["predicted_n"] == 8


def test_continuous_usage_stats_count_in_every_chunk_with_output(client) -> None:
    """vLLM's extension: each chunk that carries output says the usage so far."""
    chunks = list(
        client.completions.create(
            model=MODEL_ID,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[-1] == 6 and counted[0] >= 1
    prompt = chunks[-1].usage.prompt_tokens
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)


def test_stream_without_include_usage_has_no_usage_chunk(client) -> None:
    chunks = list(
        # Greedy: a sampled token of the tiny random model may be its end token.
        client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=4, stream=True, temperature=0
        )
    )
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_completions_text_token_ids_and_stream_agree(client, tokenizer) -> None:
    plain = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(
        model=MODEL_ID, prompt=tokenizer.encode(PROMPT), max_tokens=8, temperature=0
    )
    streamed = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    text = plain.choices[0].text
    assert plain.object == "text_completion" and text
    assert by_ids.choices[0].text == text
    assert "".join(c.choices[0].text for c in streamed) == text
    assert plain.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert plain.usage.completion_tokens == 8 and plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_cancels_the_request(client, backend, stream: bool) -> None:
    full = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    # A stop string taken from the middle of the greedy output, spanning a token boundary.
    middle = len(text) // 2
    stop = text[middle : middle + 4]
    assert len(stop) == 4
    expected = text[: text.find(stop)]
    closed_before = len(backend.closed.ids)
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL_ID,
                prompt=PROMPT,
                max_tokens=16,
                temperature=0,
                stop=[stop],
                stream=True,
            )
        )
        got = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop
        )
        got, finish = reply.choices[0].text, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens < 16
    assert got == expected and finish == "stop"
    request_id = backend.requests[-1].request_id
    assert request_id in backend.closed.wait_for(closed_before + 1, timeout_s=5.0)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, stream: bool) -> None:
    text = (
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    middle = len(text) // 2
    stop = text[middle : middle + 4]
    args = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    extra = {"include_stop_str_in_output": True}
    if stream:
        chunks = list(client.completions.create(**args, stop=[stop], stream=True, extra_body=extra))
        got = "".join(c.choices[0].text for c in chunks)
    else:
        got = client.completions.create(**args, stop=[stop], extra_body=extra).choices[0].text
    assert got == text[: text.find(stop) + len(stop)]


def test_seed_reproducibility(client, backend) -> None:
    def sample(seed: int | None, max_tokens: int = 6) -> str:
        reply = client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=max_tokens, temperature=1.0, seed=seed
        )
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert backend.requests[-1].sampling.seed == 1234
    assert backend.requests[-1].sampling.temperature == 1.0
    assert sample(99) != first
    sample(None, 1)
    sample(None, 1)
    assert backend.requests[-1].sampling.seed != backend.requests[-2].sampling.seed


def test_top_k_extension_reaches_the_backend(base_url, backend) -> None:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2, "top_k": 5, "seed": -1}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert backend.requests[-1].sampling.top_k == 5
    assert backend.requests[-1].sampling.seed == 2**64 - 1  # negative seeds wrap like int64


def test_eight_concurrent_requests(client, backend, base_url) -> None:
    def one(i: int) -> str:
        if i % 2:
            stream = client.completions.create(
                model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in stream)
        reply = client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(one, range(8)))
    assert len(set(texts)) == 1 and texts[0]
    metrics = httpx.get(f"{base_url}/metrics").text
    assert metric_value(metrics, "mesh_active_requests") == 0
    assert backend.active_count == 0


def test_models_health_and_metrics(client, base_url) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    card = models.data[0].model_extra
    assert card["max_model_len"] == card["context_length"] > 0
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    head = httpx.head(f"{base_url}/health")
    assert head.status_code == 200 and head.content == b""
    client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=3)
    # A route with parameters is labelled by its template, not "unmatched".
    httpx.get(f"{base_url}/v1/models/{MODEL_ID}")
    httpx.get(f"{base_url}/v1/responses/resp_none/input_items")
    httpx.get(f"{base_url}/no/such/route")
    response = httpx.get(f"{base_url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    ok = 'endpoint="/v1/completions",status="200"'
    assert metric_value(text, "mesh_http_requests_total", ok) >= 1
    assert metric_value(text, "mesh_prompt_tokens_total", 'endpoint="/v1/completions"') > 0
    assert metric_value(text, "mesh_completion_tokens_total", 'endpoint="/v1/completions"') >= 3
    for name in (
        "mesh_http_request_duration_seconds",
        "mesh_time_to_first_token_seconds",
        "mesh_time_per_output_token_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
        assert metric_value(text, f"{name}_count", 'endpoint="/v1/completions"') >= 1
    assert "# TYPE mesh_active_requests gauge" in text
    assert metric_value(text, "mesh_http_requests_in_flight", 'endpoint="/metrics"') == 1
    card = 'endpoint="/v1/models/{model:path}",status="200"'
    assert metric_value(text, "mesh_http_requests_total", card) == 2  # retrieve, then GET
    items = 'endpoint="/v1/responses/{response_id}/input_items",status="404"'
    assert metric_value(text, "mesh_http_requests_total", items) == 1
    assert metric_value(text, "mesh_http_requests_total", 'endpoint="unmatched",status="404"') == 1
