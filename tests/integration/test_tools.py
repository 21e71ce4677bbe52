"""Tool calling through a real 2-stage mesh, with the official openai client, and
Anthropic's Messages API with the official anthropic client.

The model is a tiny Llama trained here, in a few seconds, to answer two
conversations with known text: asked about the weather with a ``get_weather`` tool
it calls the tool; given the tool's result it answers in words. Its tokenizer and
chat template are SmolLM2's, which does not render tools, so the frontend describes
them in a system message (the generic path of ``stage/frontend/tools.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from openai import OpenAI

from coordinator.localmesh import MeshProcesses
from stage.frontend.prepare import render_chat
from stage.frontend.tools import forced_prefix, generic_messages

MODEL = "tool-llama"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ANSWERED = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY_TEXT = "It is sunny in Paris, 21 degrees."


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the frontend hands them to the template."""
    out = []
    for message in messages:
        entry = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            entry["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
        out.append(entry)
    return out


def examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token ids the model must learn, as the frontend renders them."""
    eos = [tokenizer.eos_token_id]
    ask = render_chat(tokenizer, generic_messages(template_messages(ASK), TOOLS))
    answered = render_chat(tokenizer, generic_messages(template_messages(ANSWERED), TOOLS))
    named = forced_prefix("get_weather")
    named_ids = tokenizer.encode(named, add_special_tokens=False)
    # After the forced prefix the answer goes on from inside the call.
    assert CALL_TEXT.startswith(named)
    forced_rest = CALL_TEXT[len(named) :]
    return [
        (ask, tokenizer.encode(CALL_TEXT, add_special_tokens=False) + eos),
        (answered, tokenizer.encode(REPLY_TEXT, add_special_tokens=False) + eos),
        (ask + named_ids, tokenizer.encode(forced_rest, add_special_tokens=False) + eos),
    ]


def greedy(model, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def package(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mesh.package.builder import build_package

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2))
    data = examples(tokenizer)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    learned = False
    for step in range(1, 1201):
        model.train()
        loss = torch.zeros(())
        for prompt, answer in data:
            ids = torch.tensor([prompt + answer])
            labels = ids.clone()
            labels[0, : len(prompt)] = -100
            loss = loss + model(ids, labels=labels).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 50 == 0:
            model.eval()
            if all(greedy(model, p, len(a)) == a for p, a in data):
                learned = True
                break
    assert learned, "the tiny model did not learn its answers"
    source = tmp_path_factory.mktemp("tool-model")
    model.save_pretrained(source, safe_serialization=True)
    tokenizer.save_pretrained(source)
    out = tmp_path_factory.mktemp("tool-package") / "pkg"
    build_package(str(source), out, dtype="float32", model_id=MODEL)
    return out


@pytest.fixture(scope="module")
def url(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    processes = MeshProcesses(package, tmp_path_factory.mktemp("tools"), 2)
    try:
        processes.start().wait_serving()
        yield processes.http_url
    finally:
        processes.close()


@pytest.fixture(scope="module")
def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)


def ask(client: OpenAI, messages=ASK, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0, **kwargs
    )


def test_the_model_calls_the_tool(client: OpenAI) -> None:
    reply = ask(client)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_calls_arrive_as_tool_call_deltas(client: OpenAI) -> None:
    stream = ask(client, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and calls[0]["id"]


def test_the_tool_result_goes_back_into_the_conversation(client: OpenAI) -> None:
    reply = ask(client, messages=ANSWERED)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == REPLY_TEXT


def test_a_named_tool_choice_forces_that_call(client: OpenAI) -> None:
    reply = ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_choice_none_returns_no_call(client: OpenAI) -> None:
    reply = ask(client, tool_choice="none")
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"


# ---- Anthropic's Messages API ---------------------------------------------------------

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
ANTHROPIC_ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "call_1",
                "content": '{"sky": "sunny", "celsius": 21}',
            }
        ],
    },
]


@pytest.fixture(scope="module")
def claude(url: str):
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key="unused", timeout=60, max_retries=0)


def test_messages_api_tool_use_and_tool_result(claude) -> None:
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    assert reply.stop_reason == "tool_use" and reply.role == "assistant"
    (block,) = reply.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris"} and block.id.startswith("toolu_")
    # Earlier tests sent the same prompt: most of it may come from the prefix cache.
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 50 and usage.output_tokens > 5
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=ANTHROPIC_ANSWERED,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == REPLY_TEXT


def test_messages_api_streams_text_and_tool_use(claude) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=ASK,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    with claude.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=ANTHROPIC_ANSWERED,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
        stop_sequences=["Paris"],
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == REPLY_TEXT[: REPLY_TEXT.index("Paris")]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")


def test_messages_api_errors_have_its_shape(claude) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.body["error"]["message"]
