"""The real SmolLM2-135M-Instruct, split across 2 stage processes, through the
OpenAI frontend: it answers a chat request, its greedy answer equals HF `generate`
on the unsplit model loaded from the same GGUF, and a request's greedy tokens are
the same alone and batched with 3 or 7 others."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

import httpx
import pytest
import torch
from openai import OpenAI

from coordinator.localmesh import MeshProcesses

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
NEW_TOKENS = 40


def test_split_smollm2_answers_like_unsplit_generate(tmp_path, smollm2_package, smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mesh = MeshProcesses(smollm2_package, tmp_path / "mesh", 2)
    try:
        mesh.start().wait_serving(deadline_s=300)
        stages = [s for s in mesh.status().stages if s.assigned]
        assert len(stages) == 2
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
    finally:
        mesh.close()
    answer = reply.choices[0].message.content
    assert "Paris" in answer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_package)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    if tokenizer.eos_token_id in generated:
        generated = generated[: generated.index(tokenizer.eos_token_id)]
    assert reply.usage.completion_tokens == len(generated)
    assert answer == tokenizer.decode(generated, skip_special_tokens=True)


CONCURRENT_PROMPTS = [
    "List three uses of copper.",
    "Write a haiku about winter mornings.",
    "Explain in two sentences why the sky looks blue.",
    "Translate 'good evening, friends' into Spanish.",
    "def fib(n):\n    # finish this Python function",
    "Name a famous bridge and the city it is in.",
    "What does a compiler do? One sentence.",
    "Give me a short tip for learning to juggle.",
]


def test_batched_requests_get_the_tokens_they_get_alone(tmp_path, smollm2_package):
    mesh = MeshProcesses(smollm2_package, tmp_path / "mesh", 2, max_sessions=8)
    try:
        mesh.start().wait_serving(deadline_s=300)
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)

        def answer(prompt: str) -> str:
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
            return reply.choices[0].message.content

        alone = [answer(p) for p in CONCURRENT_PROMPTS]
        for streams in (4, 8):
            with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                together = list(pool.map(answer, CONCURRENT_PROMPTS))
            assert together == alone, f"{streams} streams"
    finally:
        mesh.close()


PLACE_SCHEMA = {
    "type": "object",
    "properties": {
        "bridge": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "year_built": {"type": "integer", "minimum": 0, "maximum": 2100},
    },
    "required": ["bridge", "city", "year_built"],
    "additionalProperties": False,
}


def test_structured_output_from_the_real_model(tmp_path, smollm2_package):
    mesh = MeshProcesses(smollm2_package, tmp_path / "mesh", 2)
    try:
        mesh.start().wait_serving(deadline_s=300)
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)
        args = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [
                {"role": "user", "content": "Name a famous bridge, its city and the year built."}
            ],
            "max_tokens": 80,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": PLACE_SCHEMA, "strict": True},
            },
        }
        reply = client.chat.completions.create(**args)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert list(value) == ["bridge", "city", "year_built"]
        assert value["bridge"].strip() and value["city"].strip()
        assert 0 <= value["year_built"] <= 2100
        streamed = client.chat.completions.create(**args, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == choice.message.content
        # Any JSON object, with n = 2 sampled choices.
        json_object = {"type": "json_object"}
        many = client.chat.completions.create(
            **{**args, "response_format": json_object, "temperature": 0.7}, n=2, seed=3
        )
        for choice in many.choices:
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
            else:
                assert choice.message.content.startswith("{")
        # vLLM's and llama.cpp's constraints, as their clients send them (extra_body).
        yes_no = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
            temperature=0,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert yes_no.choices[0].message.content in ("yes", "no")
        assert yes_no.choices[0].finish_reason == "stop"
        phone = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Write a US phone number."}],
            temperature=0,
            extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
        )
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.choices[0].message.content)
        gbnf = 'root ::= "The answer is " num "."\nnum ::= [0-9]+'
        answer = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="What is 12 + 30?",
            max_tokens=20,
            temperature=0,
            extra_body={"grammar": gbnf},
        )
        assert re.fullmatch(r"The answer is \d+\.", answer.choices[0].text)
        assert answer.choices[0].finish_reason == "stop"
        # Log-probabilities of the masked distribution: where the grammar allows one
        # token (or only the end), that is all top_logprobs holds; a forbidden token
        # (-inf) never appears, streamed or not (and -inf is no JSON number).
        constrained = dict(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Say ab"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"guided_regex": "ab"},
        )
        reply = client.chat.completions.create(**constrained)
        assert reply.choices[0].message.content == "ab"
        entries = reply.choices[0].logprobs.content
        assert "".join(entry.token for entry in entries) == "ab"
        for entry in entries:
            assert 1 <= len(entry.top_logprobs) <= 3
            assert all(math.isfinite(top.logprob) for top in entry.top_logprobs)
        chunks = list(client.chat.completions.create(**constrained, stream=True))
        streamed = [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
        scored = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="What is 12 + 30?",
            max_tokens=20,
            temperature=0,
            logprobs=5,
            extra_body={"grammar": gbnf},
        )
        assert scored.choices[0].text == answer.choices[0].text
        for alternatives in scored.choices[0].logprobs.top_logprobs:
            assert alternatives and all(math.isfinite(v) for v in alternatives.values())
    finally:
        mesh.close()


EDIT_CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total += value\n"
    "    return total / len(values)\n"
)


def test_predicted_outputs_on_a_code_edit(tmp_path, smollm2_package):
    """A code edit with the original code as the prediction: the same answer as
    without it, the re-emitted lines counted as accepted, and OpenAI's counts add up."""
    mesh = MeshProcesses(smollm2_package, tmp_path / "mesh", 2)
    messages = [
        {
            "role": "user",
            "content": "Repeat this function exactly, then rename `total` to `acc`:\n\n"
            + EDIT_CODE,
        }
    ]
    try:
        mesh.start().wait_serving(deadline_s=300)
        client = OpenAI(base_url=mesh.http_url + "/v1", api_key="unused", max_retries=0)

        def ask(**extra):
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,
                max_tokens=96,
                temperature=0,
                **extra,
            )

        plain = ask(extra_body={"speculation": False})
        predicted = ask(prediction={"type": "content", "content": EDIT_CODE})
    finally:
        mesh.close()
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_package)
    predicted_tokens = len(tokenizer.encode(EDIT_CODE, add_special_tokens=False))
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == (
        predicted_tokens
    )
    # The answer starts by re-emitting the function's first lines (SmolLM2-135M then
    # drops the loop): those come back from the prediction.
    assert details.accepted_prediction_tokens >= 8, (
        details,
        predicted.choices[0].message.content,
    )


def test_windows_drafted_ahead_on_a_code_edit(tmp_path, smollm2_package):
    """20 ms on every hop: the depth rule keeps windows of the code edit in flight
    ahead of their verdicts; greedy and seeded answers equal plain decoding's."""
    mesh = MeshProcesses(
        smollm2_package, tmp_path / "mesh", 2, stage_args=("--inject-delay-ms", "20")
    )
    messages = [
        {
            "role": "user",
            "content": "Repeat this function exactly, then rename `total` to `acc`:\n\n"
            + EDIT_CODE,
        }
    ]
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 96}
    try:
        mesh.start().wait_serving(deadline_s=300)

        def ask(**extra) -> dict:
            reply = httpx.post(
                mesh.http_url + "/v1/chat/completions", json={**body, **extra}, timeout=300
            )
            assert reply.status_code == 200, reply.text
            return reply.json()

        replies = {}
        for name, sampling in (
            ("greedy", {"temperature": 0}),
            ("seeded", {"temperature": 0.8, "seed": 5}),
        ):
            plain = ask(speculation=False, **sampling)
            ahead = ask(prediction={"type": "content", "content": EDIT_CODE}, **sampling)
            replies[name] = (plain, ahead)
    finally:
        mesh.close()
    for plain, ahead in replies.values():
        assert (
            ahead["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        )
    timings = replies["greedy"][1]["timings"]
    assert timings.get("windows_ahead", 0) > 0 and timings.get("depth", 1) > 1, timings
