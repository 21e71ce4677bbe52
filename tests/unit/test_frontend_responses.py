"""OpenAI's Responses API (``POST /v1/responses``) with the official ``openai`` client,
against a real uvicorn server over a real tiny model (the answers and prompts of
``/v1/chat/completions``), and over a backend replaying a fixed answer (tool calls,
a clean end, a failure mid-stream)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from frontend_support import (
    MODEL_ID,
    ScriptedBackend,
    assert_openai_error,
    live_server,
)

from mesh.errors import Unavailable
from mesh.grammar import grammar_spec
from stage.frontend.backend import TokenEvent

QUESTION = "Write one short sentence about rivers."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
RESPONSES = "/v1/responses"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def scripted(tokenizer) -> Iterator:
    """scripted(answer, fail=None) -> (client, backend): a server whose backend answers
    every request with ``answer`` and ends it (or raises ``fail`` after its first
    tokens)."""
    stack: list = []

    def start(answer: str, fail: Exception | None = None):
        ids = tuple(tokenizer.encode(answer, add_special_tokens=False))
        ending = fail if fail is not None else TokenEvent(ids[3:], "stop")
        backend = ScriptedBackend([TokenEvent(ids[:3]), ending])
        ctx = live_server(backend, tokenizer)
        url = ctx.__enter__()
        stack.append(ctx)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        return client, backend

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_text_answer_is_the_chat_answer(client, backend, tokenizer) -> None:
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
    )
    chat_prompt_ids = list(backend.requests[-1].prompt_tokens)
    reply = client.responses.create(
        model=MODEL_ID, input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert list(backend.requests[-1].prompt_tokens) == chat_prompt_ids
    assert chat_prompt_ids == chat_prompt(tokenizer, [{"role": "user", "content": QUESTION}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.model == MODEL_ID and isinstance(reply.created_at, int | float)
    [item] = reply.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    [part] = item.content
    assert part.type == "output_text" and part.annotations == []
    usage = reply.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert reply.temperature == 0 and reply.max_output_tokens == 8 and reply.error is None
    # The same conversation as a list of items, with and without "type", string or
    # part content, reads the same prompt.
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    ]
    again = client.responses.create(input=items, max_output_tokens=8, temperature=0)
    assert list(backend.requests[-1].prompt_tokens) == chat_prompt_ids
    assert again.output_text == reply.output_text
    client.responses.create(
        input=[{"role": "user", "content": QUESTION}], max_output_tokens=1, temperature=0
    )
    assert list(backend.requests[-1].prompt_tokens) == chat_prompt_ids


def test_instructions_become_the_system_message(client, backend, tokenizer) -> None:
    client.responses.create(
        model=MODEL_ID,
        instructions="Answer in French.",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
            {"role": "user", "content": "Rivers?"},
        ],
        max_output_tokens=2,
    )
    expected = chat_prompt(
        tokenizer,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Rivers?"},
        ],
    )
    assert list(backend.requests[-1].prompt_tokens) == expected


def test_max_output_tokens_makes_the_response_incomplete(client, base_url) -> None:
    reply = client.responses.create(input=QUESTION, max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete" and reply.usage.output_tokens == 3
    events = list(
        client.responses.create(input=QUESTION, max_output_tokens=3, temperature=0, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == reply.output_text


def test_stream_deltas_join_to_the_answer(client, base_url) -> None:
    plain = client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0)
    events = list(
        client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == plain.output_text
    item_id = events[2].item.id
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    assert events[-4].text == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.id == events[0].response.id and final.output[0].id == item_id
    assert final.usage.output_tokens == 8
    # The raw wire: "event: <type>" before each "data:".
    with httpx.stream(
        "POST",
        f"{base_url}{RESPONSES}",
        json={"input": QUESTION, "max_output_tokens": 2, "stream": True},
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    for event_line, data_line in zip(lines[::2], lines[1::2], strict=True):
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"


def test_stream_helper_gives_the_final_response(scripted) -> None:
    client, _ = scripted("Rivers run to the sea.")
    with client.responses.stream(model=MODEL_ID, input=QUESTION) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Rivers run to the sea."
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "Rivers run to the sea."
    plain = client.responses.create(model=MODEL_ID, input=QUESTION)
    assert plain.status == "completed" and plain.output_text == "Rivers run to the sea."


def test_a_tool_loop(scripted, tokenizer) -> None:
    client, backend = scripted(CALL_TEXT)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = client.responses.create(model=MODEL_ID, input=ask, tools=[WEATHER])
    assert reply.status == "completed" and reply.output_text == ""
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed"
    assert reply.tools[0].name == "get_weather" and reply.tool_choice == "auto"
    # Streamed: the call as its own item, its arguments as one delta.
    with client.responses.stream(model=MODEL_ID, input=ask, tools=[WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" not in kinds
    assert kinds.count("response.function_call_arguments.delta") == 1
    assert "response.function_call_arguments.done" in kinds
    [streamed] = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    # The result goes back with the call, as the SDK returned it.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    client.responses.create(
        model=MODEL_ID,
        input=[*ask, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    chat_messages = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [chat_call(call.call_id, "Oslo")]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    base_url = str(client.base_url).removesuffix("/v1/")
    assert list(backend.requests[-1].prompt_tokens) == tokenized(base_url, chat_messages)


def chat_call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def tokenized(base_url: str, messages: list[dict]) -> list[int]:
    """The prompt a chat request with these messages and the WEATHER tool reads."""
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    body = {"messages": messages, "tools": tools}
    return httpx.post(f"{base_url}/tokenize", json=body, timeout=30).json()["tokens"]


def test_calls_join_the_assistant_turn_they_follow(client, backend, base_url) -> None:
    def call(call_id: str, city: str) -> dict:
        arguments = json.dumps({"city": city})
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": "get_weather",
            "arguments": arguments,
        }

    def result(call_id: str, text: str) -> dict:
        return {"type": "function_call_output", "call_id": call_id, "output": text}

    client.responses.create(
        input=[
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": "Looking both up."},
            call("call_a", "Oslo"),
            call("call_b", "Rome"),
            result("call_a", "sunny"),
            result("call_b", [{"type": "input_text", "text": "rain"}]),
            call("call_c", "Paris"),
            result("call_c", "fog"),
        ],
        tools=[WEATHER],
        max_output_tokens=1,
    )
    expected = tokenized(
        base_url,
        [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": "Looking both up.",
                "tool_calls": [chat_call("call_a", "Oslo"), chat_call("call_b", "Rome")],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
            {"role": "assistant", "content": None, "tool_calls": [chat_call("call_c", "Paris")]},
            {"role": "tool", "tool_call_id": "call_c", "content": "fog"},
        ],
    )
    assert list(backend.requests[-1].prompt_tokens) == expected


def test_text_before_a_call_is_a_message_item(scripted) -> None:
    client, backend = scripted("Let me check.\n" + CALL_TEXT)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = client.responses.create(model=MODEL_ID, input=ask, tools=[WEATHER])
    assert [item.type for item in reply.output] == ["message", "function_call"]
    assert reply.output_text == "Let me check."
    with client.responses.stream(model=MODEL_ID, input=ask, tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text.strip() == "Let me check."
    # The whole output goes back as the SDK returned it: one assistant turn.
    call = reply.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    sent_back = [item.model_dump(exclude_none=True) for item in reply.output]
    client.responses.create(model=MODEL_ID, input=[*ask, *sent_back, result], tools=[WEATHER])
    turn = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [chat_call(call.call_id, "Oslo")],
    }
    tool = {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    base_url = str(client.base_url).removesuffix("/v1/")
    expected = tokenized(base_url, [*ask, turn, tool])
    assert list(backend.requests[-1].prompt_tokens) == expected


def test_text_format_becomes_the_response_format(client, backend) -> None:
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string"}},
        "required": ["river"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "river", "schema": schema, "strict": True}}
    reply = client.responses.create(input=QUESTION, max_output_tokens=4, text=text)
    assert backend.requests[-1].sampling.grammar == grammar_spec("json_schema", schema)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "river"
    client.responses.create(
        input=QUESTION, max_output_tokens=4, text={"format": {"type": "json_object"}}
    )
    assert backend.requests[-1].sampling.grammar == grammar_spec("json_object")
    client.responses.create(input=QUESTION, max_output_tokens=4, text={"format": {"type": "text"}})
    assert backend.requests[-1].sampling.grammar == ""


def test_seed_and_user_reach_the_request(client, backend) -> None:
    client.responses.create(
        input=QUESTION, max_output_tokens=2, user="alice", extra_body={"seed": 7}
    )
    assert backend.requests[-1].sampling.seed == 7 and backend.requests[-1].scope == "alice"


OK = {"model": MODEL_ID, "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_123"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y.png"}],
                    }
                ]
            },
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": []}, "input"),
        ({"reasoning": {"effort": "huge"}}, "reasoning"),
        ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"temprature": 0.5}, "temprature"),
        (
            {"tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
            "text",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(base_url, extra: dict, param: str) -> None:
    response = httpx.post(f"{base_url}{RESPONSES}", json={**OK, **extra}, timeout=30)
    error = assert_openai_error(response, 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_a_previous_response_that_was_never_kept_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(input="and then?", previous_response_id="resp_abc")
    assert "not found" in caught.value.message


def test_harmless_bookkeeping_is_accepted(client) -> None:
    reply = client.responses.create(
        input=QUESTION,
        max_output_tokens=2,
        metadata={"k": "v"},
        store=False,
        truncation="disabled",
        reasoning={"effort": None},
        parallel_tool_calls=True,
    )
    assert reply.metadata == {"k": "v"} and reply.usage.output_tokens == 2


def test_a_failure_mid_stream_is_an_error_event(scripted) -> None:
    client, _ = scripted("Rivers run to the sea.", fail=Unavailable("stage 1 is gone"))
    events = list(client.responses.create(model=MODEL_ID, input=QUESTION, stream=True))
    assert events[-1].type == "error" and "stage 1 is gone" in events[-1].message
    assert "response.completed" not in [e.type for e in events]


def test_disconnect_mid_stream_cancels_the_generation(base_url, backend) -> None:
    backend.step_delay_s = 0.02
    try:
        closed_before = len(backend.closed.ids)
        body = {"input": QUESTION, "max_output_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{base_url}{RESPONSES}", json=body, timeout=30) as response:
            deltas = 0
            for line in response.iter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas >= 3:
                    break
        request_id = backend.requests[-1].request_id
        closed = backend.closed.wait_for(closed_before + 1, timeout_s=5.0)
        assert request_id in closed, "the backend did not see the request closed"
    finally:
        backend.step_delay_s = 0.0
