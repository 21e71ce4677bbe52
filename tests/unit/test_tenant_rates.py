"""Requests and tokens per minute per tenant (stage/frontend/tenant_rates.py): the
buckets on a clock of the test's own, then through a live server with the official
client (429 with Retry-After and OpenAI's x-ratelimit headers; other tenants go on)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server, metric_value

from mesh.api_keys import KeySource, TenantLimits
from stage.frontend.backend import TokenEvent
from stage.frontend.errors import OpenAIError
from stage.frontend.tenant_rates import TenantRates


def test_requests_per_minute_burst_then_refill() -> None:
    rates, limits = TenantRates(), TenantLimits(rpm=3)
    for _ in range(3):
        rates.admit("alice", limits, 0, now=0.0)
    with pytest.raises(OpenAIError) as refused:
        rates.admit("alice", limits, 0, now=1.0)
    assert refused.value.status == 429
    # One request's worth comes back every 20 s (3 per minute).
    assert refused.value.headers["Retry-After"] == "19"
    assert refused.value.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "0"
    rates.admit("alice", limits, 0, now=20.5)
    rates.admit("bob", limits, 0, now=20.5)  # a bucket per tenant
    with pytest.raises(OpenAIError):
        rates.admit("alice", limits, 0, now=21.0)


def test_tokens_per_minute_are_charged_as_they_are_known() -> None:
    rates, limits = TenantRates(), TenantLimits(tpm=600)
    rates.admit("alice", limits, 500, now=0.0)  # 100 left
    rates.admit("alice", limits, 300, now=0.0)  # admitted with some left: -200 now
    with pytest.raises(OpenAIError) as refused:
        rates.admit("alice", limits, 1, now=0.0)
    assert "600 tokens per minute" in refused.value.message
    assert refused.value.headers["Retry-After"] == "20"  # 200 tokens at 10 per second
    rates.admit("alice", limits, 1, now=20.1)
    rates.charge("alice", limits, 400)  # a long answer, charged at its end


def test_a_live_server_refuses_a_tenant_over_its_rate_and_serves_the_others(
    tokenizer, tmp_path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice key-alice-0123456789 rpm=2\nbob key-bob-0123456789 tpm=40\n")
    ids = tuple(tokenizer.encode(" the answer is here", add_special_tokens=False))
    backend = ScriptedBackend([TokenEvent(ids, "stop")])
    with live_server(backend, tokenizer, api_key=KeySource(path=keys)) as url:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)

        alice, bob = client("key-alice-0123456789"), client("key-bob-0123456789")
        ask = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        alice.chat.completions.create(**ask)
        alice.chat.completions.create(**ask)
        with pytest.raises(openai.RateLimitError) as refused:
            alice.chat.completions.create(**ask)
        headers = refused.value.response.headers
        assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-limit-requests"] == "2"
        assert refused.value.code == "rate_limit_exceeded"
        # bob's key has no request limit: requests go on while its 40 tokens last
        # (each takes its prompt's and its answer's).
        served = 0
        with pytest.raises(openai.RateLimitError) as over:
            for _ in range(10):
                bob.chat.completions.create(**ask)
                served += 1
        assert "tokens per minute" in over.value.message
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    per_request = len(backend.requests[-1].prompt_tokens) + len(ids)
    assert served == math.ceil(40 / per_request)
    assert len(backend.requests) == 2 + served  # refused requests never reached it
    limited = 'limit="requests",tenant="alice"'
    assert metric_value(metrics, "mesh_tenant_rate_limited_total", limited) == 1
