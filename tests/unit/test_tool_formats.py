"""Tool calls in the Llama 3.x JSON, Mistral ``[TOOL_CALLS]``, Qwen3-Coder XML and
GLM-4.5 XML formats: which
templates speak them, parsing, the streamed hold-back, forced prefixes, Mistral's
call ids; and through the HTTP frontend with the official openai client, a
tokenizer carrying a template of each kind and a backend that replays the model's
answer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server
from openai import OpenAI

from stage.frontend.backend import TokenEvent
from stage.frontend.tool_formats import (
    ToolFormat,
    ToolUse,
    forced_prefix,
    hold_start,
    parse_calls,
    short_call_ids,
    tool_format,
)
from stage.frontend.tools import TemplateTools, template_tools

KNOWN = ["get_weather", "get_time"]

# Templates written for these tests in the two styles (not any model's own).
LLAMA_STYLE = """
{%- for message in messages %}
{%- if loop.first and tools %}<|start_header_id|>system<|end_header_id|>

Answer a function call as {"name": ..., "parameters": ...}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- if message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in message.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_STYLE = """
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}
{%- for c in message.tool_calls %}{% if c.id | length != 9 %}\
{{ raise_exception("call ids must have 9 characters") }}{% endif %}{% endfor %}\
[TOOL_CALLS]{{ message.tool_calls | map(attribute="function") | list | tojson }}</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{"call_id": "{{ message.tool_call_id }}", \
"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""

MISTRAL_ARGS_STYLE = """
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}
{%- for c in message.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]\
{{ c.function.arguments | tojson }}{% endfor %}</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""

QWEN_XML_STYLE = """
{%- if tools %}<|im_start|>system
Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as:
<tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{% for c in message.tool_calls %}<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{%- elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GLM_XML_STYLE = """
{%- if tools %}<|system|>
Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as:
<tool_call>NAME
<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>
</tool_call>{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|assistant|>
{% for c in message.tool_calls %}<tool_call>{{ c.function.name }}
{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif message.role == "tool" %}<|observation|>
<tool_response>{{ message.content }}</tool_response>
{%- else %}<|{{ message.role }}|>
{{ message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_templates_name_their_format() -> None:
    assert tool_format(LLAMA_STYLE) is ToolFormat.LLAMA3_JSON
    assert tool_format(MISTRAL_STYLE) is ToolFormat.MISTRAL
    assert tool_format(QWEN_XML_STYLE) is ToolFormat.QWEN_XML
    assert tool_format(MISTRAL_ARGS_STYLE) is ToolFormat.MISTRAL_ARGS
    assert tool_format(GLM_XML_STYLE) is ToolFormat.GLM_XML
    assert template_tools(QWEN_XML_STYLE) is TemplateTools.NATIVE
    assert template_tools(GLM_XML_STYLE) is TemplateTools.NATIVE
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is ToolFormat.HERMES
    assert tool_format(None) is ToolFormat.HERMES
    assert template_tools(LLAMA_STYLE) is TemplateTools.NATIVE
    assert template_tools(MISTRAL_STYLE) is TemplateTools.NATIVE
    assert template_tools("{% if tools %}<function_calls>{% endif %}") is TemplateTools.OTHER


@pytest.mark.parametrize(
    ("fmt", "text", "calls"),
    [
        (ToolFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', 1),
        (
            ToolFormat.LLAMA3_JSON,
            ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "arguments": {"zone": "CET"}}',
            2,
        ),
        (ToolFormat.LLAMA3_JSON, '{"name": "unknown", "parameters": {}}', 0),
        (ToolFormat.LLAMA3_JSON, 'The answer is {"name": "get_weather"}', 0),
        (ToolFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Os', 0),
        (ToolFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {}} and more', 0),
        (
            ToolFormat.MISTRAL,
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]',
            2,
        ),
        (ToolFormat.MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', 1),
        (ToolFormat.MISTRAL, '[{"name": "get_weather", "arguments": [1]}]', 0),
        (ToolFormat.MISTRAL, "[1, 2] is a list", 0),
        (ToolFormat.MISTRAL, "Plain words.", 0),
    ],
)
def test_parsing(fmt: ToolFormat, text: str, calls: int) -> None:
    content, found = parse_calls(fmt, text, KNOWN)
    assert len(found) == calls
    if calls:
        assert content is None and found[0].name == "get_weather"
        assert json.loads(found[0].arguments) == {"city": "Oslo"}
        assert (
            len(found[0].id) == 9 if fmt is ToolFormat.MISTRAL else found[0].id.startswith("call_")
        )
        _, first = parse_calls(fmt, text, KNOWN, parallel=False)
        assert len(first) == 1
    else:
        assert content == text


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL])
def test_forced_prefixes_are_completed_into_calls(fmt: ToolFormat) -> None:
    key = "arguments" if fmt is ToolFormat.MISTRAL else "parameters"
    close = "]" if fmt is ToolFormat.MISTRAL else ""
    named = forced_prefix(fmt, "get_weather") + '{"city": "Oslo"}}' + close
    required = forced_prefix(fmt, "required") + f'get_time", "{key}": {{}}}}' + close
    assert [c.name for c in parse_calls(fmt, named, KNOWN)[1]] == ["get_weather"]
    assert [c.name for c in parse_calls(fmt, required, KNOWN)[1]] == ["get_time"]
    assert forced_prefix(fmt, "auto") == forced_prefix(fmt, "none") == ""


def test_streamed_text_is_held_only_when_it_may_be_a_call() -> None:
    llama, mistral = ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL
    assert hold_start(llama, "") == 0 and hold_start(llama, "  ") == 0
    assert hold_start(llama, ' {"name"') == 0
    assert hold_start(llama, "Sure, {x}") == len("Sure, {x}")
    assert hold_start(mistral, "[TOOL") == 0 and hold_start(mistral, "[{") == 0
    assert hold_start(mistral, "Hi [1]") == len("Hi [1]")


def test_mistral_call_ids_are_shortened_the_same_for_call_and_result() -> None:
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abcdef0123456789"}]},
        {"role": "tool", "content": "x", "tool_call_id": "call_abcdef0123456789"},
        {"role": "tool", "content": "y", "tool_call_id": "Ab3456789"},
    ]
    out = short_call_ids(messages)
    short = out[0]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and out[1]["tool_call_id"] == short
    assert out[2]["tool_call_id"] == "Ab3456789"
    assert messages[0]["tool_calls"][0]["id"] == "call_abcdef0123456789"  # not changed


# ---- through the frontend -----------------------------------------------------------


@pytest.fixture()
def serve(smollm2_tokenizer_dir) -> Iterator:
    """serve(template, answer[, special]) -> (client, backend, tokenizer): the frontend
    with a tokenizer carrying ``template`` (and ``special`` as special tokens), whose
    backend answers every request with ``answer``."""
    from transformers import AutoTokenizer

    stack: list = []

    def start(template: str, answer: str, special: tuple[str, ...] = ()):
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
        tokenizer.chat_template = template
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
        ids = tuple(tokenizer.encode(answer, add_special_tokens=False))
        backend = ScriptedBackend([TokenEvent(ids[:3]), TokenEvent(ids[3:], "stop")])
        ctx = live_server(backend, tokenizer)
        url = ctx.__enter__()
        stack.append(ctx)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        return client, backend, tokenizer

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


ASK = [{"role": "user", "content": "Weather in Oslo?"}]
ANSWERS = {
    "llama": (LLAMA_STYLE, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    "mistral": (
        MISTRAL_STYLE,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    ),
    "mistral-args": (MISTRAL_ARGS_STYLE, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    "qwen3-coder": (
        QWEN_XML_STYLE,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    "glm45": (
        GLM_XML_STYLE,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "</tool_call>",
    ),
}


@pytest.mark.parametrize("style", sorted(ANSWERS))
def test_calls_come_back_as_openai_tool_calls(serve, style: str) -> None:
    template, answer = ANSWERS[style]
    client, backend, tokenizer = serve(template, answer)
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # The template rendered the tools into the prompt.
    assert '"get_weather"' in tokenizer.decode(backend.requests[-1].prompt_tokens)
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], stream=True
    )
    content, names, arguments, finish = "", [], "", None
    for chunk in stream:
        for delta in chunk.choices:
            content += delta.delta.content or ""
            for piece in delta.delta.tool_calls or ():
                names.append(piece.function.name)
                arguments += piece.function.arguments or ""
            finish = delta.finish_reason or finish
    assert content == "" and names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(arguments) == {"city": "Oslo"}
    # The call and its result go back through the template (Mistral's wants ids
    # of 9 characters: ours, or any other client's, are fitted to it).
    follow_up = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_from_elsewhere_1", **call.model_dump(exclude={"id"})}],
        },
        {"role": "tool", "tool_call_id": "call_from_elsewhere_1", "content": "sunny"},
    ]
    again = client.chat.completions.create(model=MODEL_ID, messages=follow_up, tools=[WEATHER])
    assert again.choices[0].finish_reason == "tool_calls"
    assert "sunny" in tokenizer.decode(backend.requests[-1].prompt_tokens)


@pytest.mark.parametrize("style", sorted(ANSWERS))
def test_plain_answers_stream_as_content(serve, style: str) -> None:
    client, _, _ = serve(ANSWERS[style][0], "It is sunny in Oslo.")
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], stream=True
    )
    pieces = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == "It is sunny in Oslo." and len(pieces) >= 2


@pytest.mark.parametrize(
    ("style", "rest"),
    [
        ("qwen3-coder", "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"),
        ("glm45", "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"),
    ],
)
def test_a_named_tool_choice_starts_an_xml_call_the_model_finishes(
    serve, style: str, rest: str
) -> None:
    client, backend, tokenizer = serve(ANSWERS[style][0], rest)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice=choice
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    prompt = tokenizer.decode(backend.requests[-1].prompt_tokens)
    assert prompt.endswith(forced_prefix(tool_format(ANSWERS[style][0]), "get_weather"))


@pytest.mark.parametrize("style", sorted(ANSWERS))
def test_stop_strings_never_cut_a_tool_call(serve, style: str) -> None:
    """Stop strings end content: text inside a call's markup (a brace, an argument)
    does not cut it, offered or forced, streamed or not; before a call, the answer
    stops there as usual."""
    template, answer = ANSWERS[style]
    client, _, _ = serve(template, answer)
    inside = ["}", "Oslo", "city"]
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], stop=inside
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], stop=inside, stream=True
    )
    arguments = "".join(
        piece.function.arguments or ""
        for chunk in stream
        for delta in chunk.choices
        for piece in delta.delta.tool_calls or ()
    )
    assert json.loads(arguments) == {"city": "Oslo"}
    client, _, _ = serve(template, "It is sunny. Goodbye.")
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], stop=[" Goodbye"]
    )
    assert reply.choices[0].message.content == "It is sunny."
    assert reply.choices[0].finish_reason == "stop"


def test_stop_strings_never_cut_a_forced_call(serve) -> None:
    template = ANSWERS["qwen3-coder"][0]
    rest = "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    client, _, _ = serve(template, rest)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice=choice, stop=["Oslo", ">"]
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_a_repeated_hermes_call_is_found_where_it_starts() -> None:
    prefix = forced_prefix(ToolFormat.HERMES, "required")
    tools = ToolUse(("get_weather", "get_time"), True, prefix, ToolFormat.HERMES, grammar="g")
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    same = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    assert one.startswith(prefix)
    before = one.removeprefix(prefix) + other
    answer = before + same
    cut = tools.repeated_call(answer)
    assert cut is not None and answer[:cut] == before.rstrip("\n")
    assert tools.repeated_call(before) is None
    assert tools.repeated_call(before + same[:-3]) is None  # not whole yet
    # Only a forced choice with parallel calls is cut.
    single = ToolUse(("get_weather",), False, prefix, ToolFormat.HERMES, grammar="g")
    assert single.repeated_call(answer) is None
    assert ToolUse(("get_weather",), True, "").repeated_call(one + same) is None


@pytest.mark.parametrize("repeat", [True, False])
def test_a_required_choice_ends_before_a_repeated_call(serve, repeat: bool) -> None:
    """``tool_choice: required`` with parallel calls: a model held to calls that
    writes the same call again (it may never choose to stop) has its answer ended
    before the repeat, as ``tool_calls``; different calls all come back."""
    template = ANSWERS["qwen3-coder"][0]

    def call(city: str) -> str:
        return (
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            "</function>\n</tool_call>\n"
        )

    first = call("Oslo").removeprefix("<tool_call>\n<function=")
    second = call("Oslo" if repeat else "Rome")
    client, _, _ = serve(template, first + second + call("Bergen"))
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice="required", stream=stream
        )
        if stream:
            cities, finish = [], None
            for chunk in reply:
                for delta in chunk.choices:
                    for piece in delta.delta.tool_calls or ():
                        if piece.function.arguments:
                            cities.append(json.loads(piece.function.arguments)["city"])
                    finish = delta.finish_reason or finish
        else:
            choice = reply.choices[0]
            finish = choice.finish_reason
            cities = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
        assert finish == "tool_calls"
        assert cities == (["Oslo"] if repeat else ["Oslo", "Rome", "Bergen"])


MISTRAL_MARKS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")


@pytest.mark.parametrize(
    ("answer", "content", "calls"),
    [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None, [{"city": "Oslo"}]),
        (
            'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
            "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}",
            "Checking.",
            [{"city": "Oslo"}, {}],
        ),
        ('[TOOL_CALLS]unknown[ARGS]{"x": 1}', "same", []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Os', "same", []),
        ("[TOOL_CALLS]get_weather[ARGS][1]", "same", []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"} and more', "same", []),
        ("No call at all.", "same", []),
    ],
)
def test_mistral_name_args_calls_are_parsed(answer: str, content, calls: list) -> None:
    got_content, got = parse_calls(ToolFormat.MISTRAL_ARGS, answer, KNOWN)
    assert got_content == (answer if content == "same" else content)
    assert [json.loads(c.arguments) for c in got] == calls
    assert all(len(c.id) == 9 for c in got)
    assert hold_start(ToolFormat.MISTRAL_ARGS, "Sure.[TOOL_") == len("Sure.")
    assert hold_start(ToolFormat.MISTRAL_ARGS, "Sure.") == len("Sure.")
    assert forced_prefix(ToolFormat.MISTRAL_ARGS, "required") == "[TOOL_CALLS]"
    assert forced_prefix(ToolFormat.MISTRAL_ARGS, "get_time") == "[TOOL_CALLS]get_time[ARGS]"


def test_mistral_marks_that_are_special_tokens_stay_in_the_answer(serve) -> None:
    """Mistral's tokenizers hold [TOOL_CALLS] and [ARGS] as control tokens."""
    client, backend, tokenizer = serve(
        MISTRAL_ARGS_STYLE, ANSWERS["mistral-args"][1], MISTRAL_MARKS
    )
    assert len(tokenizer.encode("[ARGS]", add_special_tokens=False)) == 1
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER])
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice=choice
    )
    prompt = backend.requests[-1].prompt_tokens
    assert (
        list(prompt[-3:])
        == tokenizer.encode("[TOOL_CALLS]get_weather[ARGS]", add_special_tokens=False)[-3:]
    )


def test_call_marks_that_are_special_tokens_stay_in_the_answer(serve) -> None:
    """GLM tokenizers hold ``<arg_key>`` and the like as special tokens, which
    decoding would skip: the answer is decoded with them kept."""
    marks = (
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    )
    client, backend, tokenizer = serve(GLM_XML_STYLE, ANSWERS["glm45"][1], marks)
    assert tokenizer.decode(tokenizer.encode("<arg_key>"), skip_special_tokens=True) == ""
    reply = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER])
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
