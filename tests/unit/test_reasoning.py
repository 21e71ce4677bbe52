"""Reasoning models' thoughts (stage/frontend/reasoning.py): the splitter on any
chunking of the text, which requests are split, and the chat API's
``reasoning_content`` through the frontend with the official client (a scripted
backend answering as a reasoning model would)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server
from openai import OpenAI

from stage.frontend.backend import TokenEvent
from stage.frontend.prepare import FrontendLimits
from stage.frontend.reasoning import (
    MISTRAL_THINK,
    THINK,
    ReasoningSplitter,
    Tags,
    reasoning_start,
    split_reasoning,
)

# Qwen3's shape: the model opens the thought itself, and enable_thinking false puts
# an empty one in the prompt.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools> Answer with "
    "<tool_call>{...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "\n\n{%- endif %}{%- endif %}"
)
# DeepSeek-R1's shape: the template opens the thought.
R1_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)
PLAIN = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

CASES = [
    ("<think>\nSee: 2+2=4.\n</think>\n\nIt is 4.", False, ("\nSee: 2+2=4.\n", "It is 4.")),
    ("Let me see.</think>\n\nFour.", True, ("Let me see.", "Four.")),
    ("Plain answer with </think> inside", False, (None, "Plain answer with </think> inside")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("cut off while thinking <thi", True, ("cut off while thinking <thi", "")),
    ("<thi", False, (None, "<thi")),
    ("x < y, and <think> later is text", False, (None, "x < y, and <think> later is text")),
    ("", True, ("", "")),
    ("<think></think>Hi", False, (None, "Hi")),
]  # fmt: skip


@pytest.mark.parametrize(("text", "inside", "want"), CASES)
def test_the_split_is_the_same_however_the_text_is_cut(text, inside, want) -> None:
    assert split_reasoning(text, inside) == want
    rng = random.Random(7)
    for _ in range(100):
        splitter, thought, answer, at = ReasoningSplitter(inside), "", "", 0
        while at < len(text):
            step = rng.randint(1, 6)
            piece = splitter.feed(text[at : at + step])
            thought, answer, at = thought + piece[0], answer + piece[1], at + step
        piece = splitter.flush()
        assert (thought + piece[0], answer + piece[1]) == (want[0] or "", want[1])


def test_which_requests_are_split(smollm2_tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    ask = [{"role": "user", "content": "hi"}]

    def start(template: str, fmt: str = "auto", **variables) -> bool | None:
        tokenizer.chat_template = template
        prompt = tokenizer.apply_chat_template(
            ask, add_generation_prompt=True, return_dict=True, **variables
        )["input_ids"]
        thought = reasoning_start(tokenizer, prompt, fmt)
        return None if thought is None else thought.inside

    assert start(QWEN_LIKE) is False  # split; a thought only at the start of the output
    assert start(QWEN_LIKE, enable_thinking=False) is False
    assert start(R1_LIKE) is True  # the output starts inside the thought
    assert start(PLAIN) is None  # not a reasoning model
    assert start(R1_LIKE, "none") is None


@pytest.fixture()
def serve(smollm2_tokenizer_dir) -> Iterator:
    """serve(template, answer, **app) -> (client, backend, url): the frontend with a
    tokenizer carrying ``template``, answering every request with ``answer``."""
    from transformers import AutoTokenizer

    stack: list = []

    def start(template: str, answer: str, think_tokens: str = "", tags: Tags = THINK, **app):
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
        tokenizer.chat_template = template
        if think_tokens:  # "plain" as Qwen3's and DeepSeek-R1's tokenizers have them
            tokenizer.add_tokens([tags.open, tags.close], special_tokens=think_tokens == "special")
        ids = tuple(tokenizer.encode(answer, add_special_tokens=False))
        # One token per event: the tags arrive cut into pieces.
        events = [TokenEvent(ids[i : i + 1]) for i in range(len(ids) - 1)]
        backend = ScriptedBackend([*events, TokenEvent(ids[-1:], "stop")])
        ctx = live_server(backend, tokenizer, **app)
        url = ctx.__enter__()
        stack.append(ctx)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        return client, backend, url

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "The user asks for 2 + 2. That is 4."


def streamed(client: OpenAI, **extra) -> tuple[str, str, str | None, list]:
    thought, content, finish, calls = "", "", None, []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=ASK, stream=True, **extra):
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return thought, content, finish, calls


@pytest.mark.parametrize(
    ("template", "answer"),
    [
        (QWEN_LIKE, f"<think>\n{THOUGHT}\n</think>\n\n2 + 2 = 4."),
        (R1_LIKE, f"{THOUGHT}\n</think>\n\n2 + 2 = 4."),
    ],
    ids=["model-opens", "template-opens"],
)
def test_the_thought_comes_back_as_reasoning_content(serve, template, answer) -> None:
    client, _, _ = serve(template, answer)
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK)
    message = reply.choices[0].message
    assert message.content == "2 + 2 = 4."
    assert message.reasoning_content.strip() == THOUGHT
    assert reply.usage.completion_tokens > 10
    thought, content, finish, _ = streamed(client)
    assert (thought, content, finish) == (message.reasoning_content, message.content, "stop")


# Magistral's shape: the system prompt speaks of [THINK]; the 2509 release has the
# tags as special tokens.
MAGISTRAL_LIKE = (
    "[SYSTEM_PROMPT]Draft your thinking inside [THINK]...[/THINK], then answer."
    "[/SYSTEM_PROMPT]{%- for m in messages %}[INST]{{ m.content }}[/INST]{%- endfor %}"
)


@pytest.mark.parametrize("think_tokens", ["", "special"])
def test_magistral_s_think_tags_split_the_same_way(serve, think_tokens) -> None:
    answer = f"[THINK]{THOUGHT}[/THINK]2 + 2 = 4."
    client, _, _ = serve(MAGISTRAL_LIKE, answer, think_tokens, MISTRAL_THINK)
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, "2 + 2 = 4.")
    details = reply.usage.completion_tokens_details
    if think_tokens:  # single tokens: the thought's tokens are counted
        assert details.reasoning_tokens > 5
    thought, content, finish, _ = streamed(client)
    assert (thought, content, finish) == (THOUGHT, "2 + 2 = 4.", "stop")
    rng = random.Random(3)
    for _ in range(50):
        splitter, got, at = ReasoningSplitter(False, MISTRAL_THINK), ("", ""), 0
        while at < len(answer):
            step = rng.randint(1, 5)
            piece = splitter.feed(answer[at : at + step])
            got, at = (got[0] + piece[0], got[1] + piece[1]), at + step
        rest = splitter.flush()
        assert (got[0] + rest[0], got[1] + rest[1]) == (THOUGHT, "2 + 2 = 4.")


def test_tool_calls_after_a_thought_are_parsed_from_the_answer(serve) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    client, _, _ = serve(QWEN_LIKE, f"<think>\nI should call add.\n</think>\n\n{call}")
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[tool])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content.strip() == "I should call add."
    (made,) = choice.message.tool_calls
    assert made.function.name == "add" and json.loads(made.function.arguments) == {"a": 2, "b": 2}
    thought, content, finish, calls = streamed(client, tools=[tool])
    assert thought.strip() == "I should call add." and not content.strip()
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["add"]


def test_off_or_for_other_models_the_text_is_left_whole(serve) -> None:
    answer = f"<think>\n{THOUGHT}\n</think>\n\n2 + 2 = 4."
    client, _, _ = serve(QWEN_LIKE, answer, limits=FrontendLimits(reasoning_format="none"))
    message = client.chat.completions.create(model=MODEL_ID, messages=ASK).choices[0].message
    assert message.content == answer and getattr(message, "reasoning_content", None) is None
    client, _, url = serve(PLAIN, answer)
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": ASK}, timeout=30).json()
    assert reply["choices"][0]["message"]["content"] == answer
    assert "reasoning_content" not in reply["choices"][0]["message"]
    # Completions are never split.
    reply = client.completions.create(model=MODEL_ID, prompt="2+2", max_tokens=64)
    assert reply.choices[0].text == answer


def test_reasoning_effort_reaches_the_template_as_enable_thinking(serve) -> None:
    client, backend, _ = serve(QWEN_LIKE, "2 + 2 = 4.")

    def prompt(**extra) -> tuple[int, ...]:
        client.chat.completions.create(model=MODEL_ID, messages=ASK, **extra)
        return backend.requests[-1].prompt_tokens

    thinking, plain = (
        prompt(),
        prompt(extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
    )
    assert plain != thinking
    assert prompt(reasoning_effort="none") == prompt(reasoning_effort="minimal") == plain
    assert prompt(reasoning_effort="high") == prompt(reasoning_effort="low") == thinking
    # chat_template_kwargs, when it says, wins.
    both = {"chat_template_kwargs": {"enable_thinking": True}}
    assert prompt(reasoning_effort="none", extra_body=both) == thinking
    with pytest.raises(openai.BadRequestError):
        prompt(extra_body={"reasoning_effort": "extreme"})


def test_chat_template_kwargs_reach_the_template(serve) -> None:
    client, backend, url = serve(QWEN_LIKE, "2 + 2 = 4.")
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].message.content == "2 + 2 = 4."
    assert reply.choices[0].message.reasoning_content is None
    prompt = backend.requests[-1].prompt_tokens
    client.chat.completions.create(model=MODEL_ID, messages=ASK)
    assert len(backend.requests[-1].prompt_tokens) < len(prompt)  # no empty thought
    refused = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}},
        timeout=30,
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in refused.json()["error"]["message"]


ANSWER = f"<think>\n{THOUGHT}\n</think>\n\n2 + 2 = 4."


def test_messages_api_returns_a_thinking_block_first(serve, tokenizer) -> None:
    import anthropic

    _, backend, url = serve(QWEN_LIKE, ANSWER)
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask = {"model": MODEL_ID, "max_tokens": 200, "messages": ASK}
    reply = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking.strip() == THOUGHT and reply.content[1].text == "2 + 2 = 4."
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == reply.content[0].thinking
    assert final.content[1].text == "2 + 2 = 4."
    # A thought sent back in the history is accepted and not shown to the model.
    thought = {"type": "thinking", "thinking": "SECRET-THOUGHT", "signature": ""}
    history = [
        *ASK,
        {"role": "assistant", "content": [thought, {"type": "text", "text": "4"}]},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    client.messages.create(model=MODEL_ID, max_tokens=50, messages=history)
    assert "SECRET-THOUGHT" not in last_prompt(backend, tokenizer)
    # thinking disabled reaches the template as enable_thinking false (an empty thought).
    client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    assert last_prompt(backend, tokenizer).endswith("assistant")
    client.messages.create(**ask, thinking={"type": "disabled"})
    assert last_prompt(backend, tokenizer).endswith("<think>\n\n</think>")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def last_prompt(backend, tokenizer) -> str:
    return tokenizer.decode(backend.requests[-1].prompt_tokens)


def test_responses_api_returns_a_reasoning_item_first(serve, tokenizer) -> None:
    client, backend, _ = serve(QWEN_LIKE, ANSWER)
    reply = client.responses.create(model=MODEL_ID, input="What is 2 + 2?")
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text.strip() == THOUGHT
    assert reply.output_text == "2 + 2 = 4."
    with client.responses.stream(model=MODEL_ID, input="What is 2 + 2?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == reply.output[0].content[0].text
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "2 + 2 = 4."
    # Effort none asks the template for no thought; earlier reasoning items are accepted.
    again = client.responses.create(
        model=MODEL_ID,
        input=[
            {"role": "user", "content": "What is 2 + 2?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        reasoning={"effort": "none"},
    )
    assert again.reasoning.effort == "none"
    assert last_prompt(backend, tokenizer).endswith("<think>\n\n</think>")


@pytest.mark.parametrize(
    ("template", "answer"),
    [(QWEN_LIKE, ANSWER), (R1_LIKE, f"{THOUGHT}\n</think>\n\n2 + 2 = 4.")],
    ids=["model-opens", "template-opens"],
)
@pytest.mark.parametrize("kind", ["plain", "special"])
def test_usage_counts_the_thought_tokens_where_the_tags_are_tokens(
    serve, tokenizer, template, answer, kind
) -> None:
    client, _, _ = serve(template, answer, think_tokens=kind)
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK)
    assert reply.choices[0].message.content == "2 + 2 = 4."
    answer_tokens = len(tokenizer.encode("\n\n2 + 2 = 4.", add_special_tokens=False))
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens == reply.usage.completion_tokens - answer_tokens
    response = client.responses.create(model=MODEL_ID, input="What is 2 + 2?")
    assert response.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    # Where the tags are not single tokens, the thought is not counted.
    client, _, _ = serve(template, answer)
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK)
    assert reply.usage.completion_tokens_details is None
