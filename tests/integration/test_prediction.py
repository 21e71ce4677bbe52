"""Predicted Outputs and per-request speculation control through a real 2-stage mesh,
with the official ``openai`` client: a prediction (right, edited, wrong, empty,
longer than max_tokens) never changes the answer, streamed or not, greedy or
seeded; ``usage.completion_tokens_details`` is there (its counts are checked on
SmolLM2 in tests/e2e); ``speculation: false`` and ``{"max_window": N}`` change nothing
but speed; a malformed prediction is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "def add(x, y):\n    return x + y\n"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_package_factory):
    package = tiny_package_factory("llama", layers=4)
    processes = MeshProcesses(package, tmp_path_factory.mktemp("prediction"), 2)
    try:
        processes.start().wait_serving()
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="module")
def client(mesh) -> OpenAI:
    return OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)


def ask(client: OpenAI, seed: int | None = None, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0 if seed is None else 0.9,
        seed=seed,
        **extra,
    )


@pytest.mark.parametrize("seed", [None, 7])
def test_a_prediction_never_changes_the_answer(client: OpenAI, seed: int | None) -> None:
    reference = ask(client, seed).choices[0].message.content
    assert reference
    edited = (
        reference[: len(reference) // 3] + " inserted words " + reference[len(reference) // 2 :]
    )
    predictions = {
        "right": reference,
        "edited": edited,
        "another language": "Ceci n'est pas du tout la réponse attendue, loin de là.",
        "empty": "",
        "longer than max_tokens": reference * 4,
        "as text parts": [
            {"type": "text", "text": reference[:10]},
            {"type": "text", "text": reference[10:]},
        ],
    }
    for name, content in predictions.items():
        reply = ask(client, seed, prediction={"type": "content", "content": content})
        assert reply.choices[0].message.content == reference, name
        details = reply.usage.completion_tokens_details
        assert details is not None, name
        accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
        # The random model's tokens need not come back when its text is encoded
        # again, so only the totals are checked here (tests/e2e: SmolLM2's counts).
        assert accepted >= 0 and rejected >= 0
        if name == "empty":
            assert (accepted, rejected) == (0, 0)
    plain = ask(client, seed)
    assert plain.usage.completion_tokens_details is None


def test_streamed_with_a_prediction(client: OpenAI) -> None:
    reference = ask(client).choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": reference},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == reference
    assert usage is not None and usage.completion_tokens_details is not None


def test_completions_take_a_prediction_too(client: OpenAI) -> None:
    def complete(**extra) -> object:
        return client.completions.create(
            model=MODEL, prompt="one two three four", max_tokens=24, temperature=0, **extra
        )

    reference = complete()
    text = reference.choices[0].text
    reply = complete(extra_body={"prediction": {"type": "content", "content": text}})
    assert reply.choices[0].text == text
    assert reply.usage.completion_tokens_details is not None


def test_speculation_off_or_capped_changes_nothing_but_speed(client: OpenAI, mesh) -> None:
    reference = ask(client).choices[0].message.content
    for control in (False, True, {"max_window": 1}, {"max_window": 3}):
        reply = ask(client, extra_body={"speculation": control})
        assert reply.choices[0].message.content == reference, control
    with_prediction = ask(
        client,
        prediction={"type": "content", "content": reference},
        extra_body={"speculation": False},
    )
    assert with_prediction.choices[0].message.content == reference
    # Counted against the completion even when nothing was drafted from it.
    assert with_prediction.usage.completion_tokens_details is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prediction": {"type": "text", "content": "x"}}, "prediction"),
        ({"prediction": {"type": "content"}}, "prediction"),
        ({"prediction": "x"}, "prediction"),
        ({"speculation": {"max_window": 0}}, "speculation"),
        ({"speculation": "yes"}, "speculation"),
    ],
)
def test_malformed_controls_are_refused(client: OpenAI, mesh, body: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as error:
        ask(client, extra_body=body)
    assert param in str(error.value)
    # And the server carries on.
    assert httpx.get(mesh.http_url + "/health", timeout=30).status_code == 200
