"""Continuing the last assistant message (assistant prefill): vLLM's
``continue_final_message`` on chat completions, and a final assistant message on
Anthropic's Messages API, which that API always continues."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from frontend_support import MODEL_ID, assert_openai_error
from openai import OpenAI

PREFILL = '{"city": "'
ASK = [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}]


def last_prompt(backend, tokenizer) -> str:
    return tokenizer.decode(backend.requests[-1].prompt_tokens)


def test_continue_final_message_continues_the_assistants_text(base_url, backend, tokenizer):
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    messages = [*ASK, {"role": "assistant", "content": PREFILL}]
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.choices[0].message.content  # the continuation only
    assert last_prompt(backend, tokenizer).endswith(PREFILL)
    # Without it, the same messages close the assistant's turn and open a new one.
    client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2)
    opened = last_prompt(backend, tokenizer)
    assert not opened.endswith(PREFILL) and PREFILL in opened
    # add_generation_prompt false alone leaves the next turn unopened.
    client.chat.completions.create(
        model=MODEL_ID, messages=ASK, max_tokens=2, extra_body={"add_generation_prompt": False}
    )
    assert last_prompt(backend, tokenizer).rstrip().endswith("<|im_end|>")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True}, "add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": False, "messages": ASK},
            "continue_final_message",
        ),
    ],
)
def test_continue_final_message_needs_an_assistant_message_and_no_new_turn(
    base_url, extra, param
) -> None:
    body = {"messages": [*ASK, {"role": "assistant", "content": PREFILL}], **extra}
    reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(reply, 400, param=param)


def test_the_messages_api_continues_a_final_assistant_message(base_url, backend, tokenizer):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    messages = [*ASK, {"role": "assistant", "content": PREFILL}]
    reply = client.messages.create(model=MODEL_ID, max_tokens=4, messages=messages)
    assert reply.content[0].type == "text" and reply.usage.output_tokens == 4
    assert last_prompt(backend, tokenizer).endswith(PREFILL)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(
            model=MODEL_ID,
            max_tokens=4,
            messages=[*ASK, {"role": "assistant", "content": "The answer: "}],
        )
