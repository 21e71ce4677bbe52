"""The model's own sampling defaults (stage/frontend/model_defaults.py): read from a
package's generation_config.json, applied to what a request leaves unset, reported
by /props; through the HTTP frontend with the official openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server
from openai import OpenAI

from stage.frontend.backend import TokenEvent
from stage.frontend.model_defaults import SamplingDefaults
from stage.frontend.prepare import FrontendLimits

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "do_sample": True}


def write_config(directory: Path, values: dict) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_the_package_recommendation_is_read(tmp_path: Path) -> None:
    got = SamplingDefaults.of_package(write_config(tmp_path, {**QWEN3, "repetition_penalty": 1.05}))
    assert got == SamplingDefaults(0.6, 0.95, 20, 0.0, 1.05)


def test_what_a_request_could_not_set_is_ignored(tmp_path: Path) -> None:
    odd = {"temperature": 7.0, "top_p": 0, "top_k": 2.5, "min_p": "x", "repetition_penalty": True}
    assert SamplingDefaults.of_package(write_config(tmp_path, odd)) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("{broken")
    assert SamplingDefaults.of_package(tmp_path) == SamplingDefaults()
    assert SamplingDefaults.of_package(tmp_path / "missing") == SamplingDefaults()


@pytest.fixture()
def served(smollm2_tokenizer):
    backend = ScriptedBackend([TokenEvent((17, 18), "stop")])
    limits = FrontendLimits(sampling_defaults=SamplingDefaults(0.6, 0.95, 20, 0.05, 1.1))
    with live_server(backend, smollm2_tokenizer, limits=limits) as url:
        yield url, backend


def test_unset_parameters_take_the_model_defaults_and_set_ones_stay(served) -> None:
    url, backend = served
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=MODEL_ID, messages=ask)
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 20)
    assert (sampling.min_p, sampling.repetition_penalty) == (0.05, 1.1)
    client.chat.completions.create(
        model=MODEL_ID, messages=ask, temperature=0.0, top_p=0.5, extra_body={"top_k": 0}
    )
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, 0)
    # Anthropic's API leaves its temperature to the model too, unless it sets one.
    httpx.post(
        url + "/v1/messages",
        json={"model": MODEL_ID, "max_tokens": 4, "messages": ask},
        timeout=30,
    ).raise_for_status()
    assert backend.requests[-1].sampling.temperature == 0.6
    params = httpx.get(url + "/props", timeout=30).json()["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["min_p"]) == (0.6, 20, 0.05)
