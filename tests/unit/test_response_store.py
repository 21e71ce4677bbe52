"""Stored responses (stage/frontend/response_store.py, responses_routes.py): turns
chained with ``previous_response_id`` through the official client, retrieve, list
input items, delete, ``store: false``, item references, tenants kept apart, the
bound, and the store off."""

from __future__ import annotations

import httpx
import openai
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server

from mesh.api_keys import KeySource
from stage.frontend.backend import TokenEvent
from stage.frontend.prepare import FrontendLimits
from stage.frontend.response_store import ResponseStore

ANSWER = "Nice to meet you, Ada."
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def _backend(tokenizer, answer: str = ANSWER) -> ScriptedBackend:
    ids = tuple(tokenizer.encode(answer, add_special_tokens=False))
    return ScriptedBackend([TokenEvent(ids[:2]), TokenEvent(ids[2:], "stop")])


def _prompt(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_chain_of_turns_reads_the_whole_conversation(tokenizer) -> None:
    backend = _backend(tokenizer)
    with live_server(backend, tokenizer) as url:
        client = _client(url)
        # previous_response_id None (sent as null by the SDKs: an agent's first turn)
        # is no previous response.
        first = client.responses.create(
            model=MODEL_ID,
            instructions="Be brief.",
            input="My name is Ada.",
            previous_response_id=None,
        )
        assert first.store is True and first.output_text == ANSWER
        second = client.responses.create(
            model=MODEL_ID, input="What is my name?", previous_response_id=first.id
        )
        assert second.previous_response_id == first.id
        # Streamed turns are kept too.
        with client.responses.stream(
            model=MODEL_ID, input="Say it again.", previous_response_id=second.id
        ) as stream:
            third = stream.get_final_response()
        fourth = client.responses.create(
            model=MODEL_ID, input="Once more.", previous_response_id=third.id
        )
        assert fourth.output_text == ANSWER
        # Retrieve, list the input, delete.
        assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
        # Streaming a retrieve replays a background response; none is: a clear 400,
        # not an empty stream.
        with pytest.raises(openai.BadRequestError, match="not created with background") as no:
            client.responses.retrieve(second.id, stream=True)
        assert no.value.body["param"] == "stream"
        items = client.responses.input_items.list(fourth.id, order="asc")
        texts = [getattr(i, "content", None) for i in items.data]
        assert len(texts) == 7  # 4 user turns and 3 answers
        # As OpenAI lists them: text as parts (input_text for the user's, output_text
        # for the answers), each message completed.
        assert items.data[0].content[0].text == "My name is Ada."
        assert [i.content[0].type for i in items.data[:2]] == ["input_text", "output_text"]
        assert items.data[1].content[0].text == ANSWER
        assert all(i.status == "completed" for i in items.data)
        # Pages of 2, as the SDK walks them (by each page's last id): every item,
        # each with its type and an id of its own.
        paged = list(client.responses.input_items.list(fourth.id, limit=2, order="asc"))
        assert [i.model_dump() for i in paged] == [i.model_dump() for i in items.data]
        assert len({i.id for i in paged}) == 7 and all(i.type == "message" for i in paged)
        newest = client.responses.input_items.list(fourth.id, limit=3)
        assert [i.id for i in newest.data] == [i.id for i in paged][::-1][:3]
        assert newest.first_id == paged[-1].id and newest.has_more
        with pytest.raises(openai.BadRequestError, match="after"):
            client.responses.input_items.list(fourth.id, after="msg_nothing")
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        # A later turn still stands on its own copy of the conversation.
        assert client.responses.retrieve(second.id).id == second.id
    conversation = [{"role": "user", "content": "My name is Ada."}]
    # Instructions are not carried over to the next turn (OpenAI's rule).
    assert list(backend.requests[0].prompt_tokens) == _prompt(
        tokenizer, [{"role": "system", "content": "Be brief."}, *conversation]
    )
    for turn, ask in enumerate(["What is my name?", "Say it again.", "Once more."], start=1):
        conversation += [
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": ask},
        ]
        assert list(backend.requests[turn].prompt_tokens) == _prompt(tokenizer, conversation)


def test_input_tokens_counts_the_prompt_a_create_would_take(tokenizer) -> None:
    backend = _backend(tokenizer)
    with live_server(backend, tokenizer) as url:
        client = _client(url)
        first = client.responses.create(model=MODEL_ID, input="My name is Ada.")
        counted = client.responses.input_tokens.count(
            model=MODEL_ID, input="What is my name?", previous_response_id=first.id
        )
        alone = client.responses.input_tokens.count(input="My name is Ada.")
        with pytest.raises(openai.NotFoundError):
            client.responses.input_tokens.count(input="Hi", previous_response_id="resp_none")
        with pytest.raises(openai.BadRequestError) as empty:
            client.responses.input_tokens.count(input=[])
        second = client.responses.create(
            model=MODEL_ID, input="What is my name?", previous_response_id=first.id
        )
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == second.usage.input_tokens
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "What is my name?"},
    ]
    assert counted.input_tokens == len(_prompt(tokenizer, conversation))
    assert alone.input_tokens == len(_prompt(tokenizer, conversation[:1]))
    assert empty.value.body["param"] == "input"
    # Counting stores nothing and runs nothing: two creates reached the backend.
    assert len(backend.requests) == 2


def test_store_false_keeps_nothing_and_references_resolve(tokenizer) -> None:
    backend = _backend(tokenizer)
    with live_server(backend, tokenizer) as url:
        client = _client(url)
        gone = client.responses.create(model=MODEL_ID, input="hi", store=False)
        assert gone.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
        kept = client.responses.create(model=MODEL_ID, input="hi")
        message_id = kept.output[0].id
        referenced = httpx.post(
            f"{url}/v1/responses",
            json={"input": [{"type": "item_reference", "id": message_id},
                            {"role": "user", "content": "and?"}]},
            timeout=30,
        )  # fmt: skip
        assert referenced.status_code == 200, referenced.text
        unknown = httpx.post(
            f"{url}/v1/responses",
            json={"input": [{"type": "item_reference", "id": "msg_nope"}]},
            timeout=30,
        )
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "input"
    assert list(backend.requests[2].prompt_tokens) == _prompt(
        tokenizer, [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "and?"}]
    )


def test_a_tool_call_turn_continues_with_its_output(tokenizer) -> None:
    backend = _backend(tokenizer, CALL_TEXT)
    with live_server(backend, tokenizer) as url:
        client = _client(url)
        asked = client.responses.create(model=MODEL_ID, input="Weather in Oslo?", tools=[WEATHER])
        call = asked.output[0]
        assert call.type == "function_call"
        client.responses.create(
            model=MODEL_ID,
            previous_response_id=asked.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=[WEATHER],
        )
    text = tokenizer.decode(backend.requests[1].prompt_tokens)
    assert "Weather in Oslo?" in text and "get_weather" in text and "sunny" in text


def test_another_key_can_neither_read_nor_continue_a_response(tokenizer, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice key-alice-0123456789\nbob key-bob-0123456789\n")
    backend = _backend(tokenizer)
    with live_server(backend, tokenizer, api_key=KeySource(path=keys)) as url:
        alice, bob = _client(url, "key-alice-0123456789"), _client(url, "key-bob-0123456789")
        made = alice.responses.create(model=MODEL_ID, input="secret plan")
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=MODEL_ID, input="and?", previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(made.id)
        assert alice.responses.retrieve(made.id).id == made.id


def test_the_store_keeps_the_latest_and_can_be_off(tokenizer) -> None:
    backend = _backend(tokenizer)
    with live_server(backend, tokenizer, limits=FrontendLimits(stored_responses=2)) as url:
        client = _client(url)
        made = [client.responses.create(model=MODEL_ID, input=f"turn {i}") for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
        assert client.responses.retrieve(made[2].id).id == made[2].id
    with live_server(backend, tokenizer, limits=FrontendLimits(stored_responses=0)) as url:
        client = _client(url)
        answer = client.responses.create(model=MODEL_ID, input="hi")
        assert answer.store is False
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL_ID, input="and?", previous_response_id=answer.id)
        assert "send the whole conversation" in caught.value.message


def test_the_bound_on_stored_text() -> None:
    store = ResponseStore(limit=100, max_chars=400)
    for i in range(5):
        store.put("", {"id": f"r{i}", "output": [{"id": f"m{i}", "text": "x" * 100}]}, [])
    kept = [i for i in range(5) if store.item("", f"m{i}") is not None]
    assert kept == [3, 4]
