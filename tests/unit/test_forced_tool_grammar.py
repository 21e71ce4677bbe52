"""A forced ``tool_choice`` (``required``, or a named function) keeps the answer to
well-formed calls whose arguments follow the function's ``parameters`` schema: the
grammar of each tool-call format on SmolLM2's real tokenizer (what it lets through,
what it forbids, where it ends), and the request the frontend sends for it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from frontend_support import MODEL_ID, ScriptedBackend, live_server
from openai import BadRequestError, OpenAI

from mesh.grammar import TokenGrammars, grammar_spec
from stage.frontend.backend import TokenEvent
from stage.frontend.tool_formats import (
    ToolFormat,
    forced_call_grammar,
    forced_prefix,
    parse_calls,
)

VOCAB = 49152
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
# A function without parameters, and one whose schema refers to its definitions
# (as pydantic writes them).
CLOCK = {"type": "function", "function": {"name": "get_time"}}
BOOKING = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"guest": {"$ref": "#/$defs/Guest"}},
            "required": ["guest"],
            "$defs": {
                "Guest": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
TOOLS = [WEATHER, CLOCK, BOOKING]
NAMES = ["get_weather", "get_time", "book"]
WEATHER_ARGS = '{"city": "Oslo", "days": 2}'


def follows(smollm2_grammars: TokenGrammars, spec: str, ids: list[int]) -> list[int] | None:
    """The tokens the grammar allows after ``ids`` if it allows every token of them in
    turn, else None."""
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    for i, token in enumerate(ids):
        constraint.sync(ids[:i])
        if not constraint.allowed()[token]:
            return None
    constraint.sync(ids)
    return constraint.allowed().nonzero().flatten().tolist()


def first_refused(
    smollm2_grammars: TokenGrammars, spec: str, smollm2_tokenizer, text: str
) -> str | None:
    """The first piece of ``text`` (as tokenized) the grammar forbids, else None."""
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    constraint = smollm2_grammars.constraint(spec, VOCAB)
    for i, token in enumerate(ids):
        constraint.sync(ids[:i])
        if not constraint.allowed()[token]:
            return smollm2_tokenizer.decode(ids[: i + 1])
    return None


# (format, choice, parallel) -> answers after the forced prefix that the grammar takes,
# with the calls they parse into.
ACCEPTED = {
    (ToolFormat.HERMES, "required", True): [
        (WEATHER_ARGS.join(['{"name": "get_weather", "arguments": ', "}\n</tool_call>"]), 1),
        (
            '{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
            '{"name": "book", "arguments": {"guest": {"name": "Ada"}}}\n</tool_call>',
            2,
        ),
    ],
    (ToolFormat.HERMES, "get_weather", True): [(WEATHER_ARGS + "}\n</tool_call>", 1)],
    (ToolFormat.LLAMA3_JSON, "required", True): [
        ('get_weather", "parameters": ' + WEATHER_ARGS + "}", 1),
        ('book", "parameters": {"guest": {"name": "Ada"}}}', 1),
    ],
    (ToolFormat.LLAMA3_JSON, "get_weather", True): [(WEATHER_ARGS + "}", 1)],
    (ToolFormat.MISTRAL, "required", True): [
        (
            'get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
            + WEATHER_ARGS
            + "}]",
            2,
        ),
    ],
    (ToolFormat.MISTRAL, "required", False): [('get_time", "arguments": {}}]', 1)],
    (ToolFormat.MISTRAL, "get_weather", True): [(WEATHER_ARGS + "}]", 1)],
}


@pytest.mark.parametrize("case", list(ACCEPTED), ids=lambda c: f"{c[0].value}-{c[1]}-{c[2]}")
def test_the_grammar_takes_well_formed_calls_and_ends_after_them(
    smollm2_grammars, smollm2_tokenizer, case: tuple[ToolFormat, str, bool]
) -> None:
    fmt, choice, parallel = case
    spec = grammar_spec("grammar", forced_call_grammar(fmt, choice, TOOLS, parallel))
    for answer, count in ACCEPTED[case]:
        ids = smollm2_tokenizer.encode(answer, add_special_tokens=False)
        after = follows(smollm2_grammars, spec, ids)
        assert after is not None, answer
        # The end, and (Hermes, parallel calls) the line that opens another call.
        ends = [smollm2_tokenizer.eos_token_id]
        if fmt is ToolFormat.HERMES and parallel and choice == "required":
            ends += smollm2_tokenizer.encode("\n", add_special_tokens=False)
        assert sorted(after) == sorted(ends), answer
        # What the grammar lets through is what the parser reads as calls.
        content, calls = parse_calls(fmt, forced_prefix(fmt, choice) + answer, NAMES, parallel)
        assert len(calls) == count and content is None, answer


# Answers the grammar must stop, and the part where it must stop them: the wrong
# name, argument or text.
REFUSED = [
    (ToolFormat.HERMES, "required", '{"name": "delete_everything", "arguments": {}}', "del"),
    (ToolFormat.HERMES, "required", "I cannot call a tool for that.", "I"),
    (ToolFormat.HERMES, "required", '{"name": "get_weather", "arguments": {"city": 7', "7"),
    (ToolFormat.HERMES, "get_weather", '{"city": "Oslo", "when": "now"}', "when"),
    (ToolFormat.HERMES, "get_weather", '{"city": "Oslo"}}', "}"),  # days is required
    (ToolFormat.LLAMA3_JSON, "required", 'get_wind", "parameters": {}}', "get_w"),
    (ToolFormat.MISTRAL, "required", 'book", "arguments": {"guest": "Ada"}}]', '"Ada"'),
]


@pytest.mark.parametrize("fmt, choice, answer, where", REFUSED)
def test_the_grammar_refuses_other_functions_arguments_and_text(
    smollm2_grammars, smollm2_tokenizer, fmt: ToolFormat, choice: str, answer: str, where: str
) -> None:
    spec = grammar_spec("grammar", forced_call_grammar(fmt, choice, TOOLS))
    refused = first_refused(smollm2_grammars, spec, smollm2_tokenizer, answer)
    assert refused is not None, answer
    # Refused at the first token that reaches into the wrong part.
    wrong = answer.index(where)
    assert wrong < len(refused) <= wrong + len(where) + 4, (refused, where)


def test_keywords_the_library_lacks_are_left_out_and_the_rest_is_held(
    smollm2_grammars, smollm2_tokenizer
) -> None:
    """``not`` is not implemented by the grammar library: the call is still held to
    its name and the argument's type, the ``not`` alone goes unenforced."""
    odd = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "type": "object",
                "properties": {"label": {"type": "string", "not": {"const": "x"}}},
                "required": ["label"],
                "additionalProperties": False,
            },
        },
    }
    spec = grammar_spec("grammar", forced_call_grammar(ToolFormat.HERMES, "tag", [odd]))
    ids = smollm2_tokenizer.encode('{"label": "x"}}\n</tool_call>', add_special_tokens=False)
    assert follows(smollm2_grammars, spec, ids) == [smollm2_tokenizer.eos_token_id]
    assert first_refused(smollm2_grammars, spec, smollm2_tokenizer, '{"label": 5}') is not None


def test_a_free_choice_has_no_grammar_and_clashing_definitions_leave_calls_free() -> None:
    for fmt in ToolFormat:
        assert forced_call_grammar(fmt, "auto", TOOLS) == ""
        assert forced_call_grammar(fmt, "none", TOOLS) == ""
    other = json.loads(json.dumps(BOOKING))
    other["function"]["name"] = "rebook"
    other["function"]["parameters"]["$defs"]["Guest"]["required"] = []
    assert forced_call_grammar(ToolFormat.HERMES, "required", [BOOKING, other]) == ""
    # The same definition in two functions is one definition.
    same = json.loads(json.dumps(BOOKING))
    same["function"]["name"] = "rebook"
    assert forced_call_grammar(ToolFormat.HERMES, "required", [BOOKING, same])


BROKEN = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"$ref": "#/$defs/Missing"}},
            "required": ["key"],
        },
    },
}


@pytest.mark.parametrize("choice", ["lookup", "required"])
def test_schemas_the_library_cannot_follow_still_hold_calls_to_names_and_objects(
    smollm2_grammars, smollm2_tokenizer, caplog: pytest.LogCaptureFixture, choice: str
) -> None:
    """A schema referring to a definition it lacks cannot be compiled: the answer is
    still held to a call of the request's functions with a JSON object as arguments
    (before, it ran free after the forced start), and a warning says why."""
    from stage.frontend.prepare import _forced_call_spec

    with caplog.at_level("WARNING"):
        spec = _forced_call_spec(ToolFormat.HERMES, choice, [BROKEN, CLOCK], True)
    assert "not to their schemas" in caplog.text and "Missing" in caplog.text
    start = "" if choice == "lookup" else '{"name": "lookup", "arguments": '
    ids = smollm2_tokenizer.encode(
        start + '{"key": [1, "x"]}}\n</tool_call>', add_special_tokens=False
    )
    assert follows(smollm2_grammars, spec, ids) is not None
    assert first_refused(smollm2_grammars, spec, smollm2_tokenizer, start + "[1]") is not None
    if choice == "required":
        wrong = '{"name": "erase", "arguments": {}}'
        assert first_refused(smollm2_grammars, spec, smollm2_tokenizer, wrong) is not None
    # Clashing definitions in two functions: held to names and objects too.
    other = json.loads(json.dumps(BOOKING))
    other["function"]["name"] = "rebook"
    other["function"]["parameters"]["$defs"]["Guest"]["required"] = []
    spec = _forced_call_spec(ToolFormat.HERMES, "required", [BOOKING, other], True)
    assert spec and '"rebook' in json.loads(spec)["lark"]
    # Formats without a call grammar stay free.
    assert _forced_call_spec(ToolFormat.QWEN_XML, "required", [BROKEN], True) == ""
    # A schema that compiles but that the library cannot follow with the model's
    # tokenizer (only a reference to itself): the check the backend offers finds it.
    selfish = {"type": "function", "function": {"name": "lookup", "parameters": {"$ref": "#"}}}
    ctx = SimpleNamespace(check_grammar=lambda spec: smollm2_grammars.check(spec, VOCAB))
    spec = _forced_call_spec(ToolFormat.HERMES, "lookup", [selfish], True, ctx)
    ids = smollm2_tokenizer.encode('{"any": 1}}\n</tool_call>', add_special_tokens=False)
    assert follows(smollm2_grammars, spec, ids) is not None


# ---- the request the frontend sends ----------------------------------------------


@pytest.fixture()
def frontend(smollm2_tokenizer):
    """(client, backend): SmolLM2's tokenizer (whose template ignores tools: Hermes
    calls described in a system message) and a backend that answers with a call."""
    answer = WEATHER_ARGS + "}\n</tool_call>"
    ids = tuple(smollm2_tokenizer.encode(answer, add_special_tokens=False))
    backend = ScriptedBackend([TokenEvent(ids, "stop")])
    with live_server(backend, smollm2_tokenizer) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30), backend


ASK = [{"role": "user", "content": "Weather in Oslo for two days?"}]


def test_a_forced_choice_sends_its_grammar_and_a_free_one_none(frontend) -> None:
    client, backend = frontend
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=named
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    sent = json.loads(backend.requests[-1].sampling.grammar)
    assert sent["type"] == "lark" and '"days"' in sent["lark"]
    client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required"
    )
    assert "get_time" in json.loads(backend.requests[-1].sampling.grammar)["lark"]
    client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS)
    assert backend.requests[-1].sampling.grammar == ""


def _allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_offers_only_those_in_their_mode(frontend, smollm2_tokenizer) -> None:
    """OpenAI's ``allowed_tools`` tool_choice: the prompt describes only the allowed
    tools, ``required`` forces a call among them, ``auto`` leaves the choice free."""
    client, backend = frontend
    allowed = _allowed("required", "get_weather", "get_time")
    client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=allowed)
    lark = json.loads(backend.requests[-1].sampling.grammar)["lark"]
    assert "get_weather" in lark and "get_time" in lark and '"book"' not in lark
    prompt = smollm2_tokenizer.decode(backend.requests[-1].prompt_tokens)
    assert "get_weather" in prompt and '"book"' not in prompt
    # The same prompt as a request that sends only the allowed tools.
    client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS[:2], tool_choice="required"
    )
    assert backend.requests[-1].prompt_tokens == backend.requests[-2].prompt_tokens
    client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=_allowed("auto", "book")
    )
    assert backend.requests[-1].sampling.grammar == ""
    prompt = smollm2_tokenizer.decode(backend.requests[-1].prompt_tokens)
    assert '"book"' in prompt and "get_weather" not in prompt
    # The Responses API's flat shape.
    answer = client.responses.create(
        model=MODEL_ID,
        input="Weather in Oslo for two days?",
        tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
    )
    lark = json.loads(backend.requests[-1].sampling.grammar)["lark"]
    assert "get_weather" in lark and "get_time" not in lark
    assert answer.tool_choice.type == "allowed_tools" and answer.tool_choice.mode == "required"
    assert [tool["name"] for tool in answer.tool_choice.tools] == ["get_weather"]
    requests = len(backend.requests)
    with pytest.raises(BadRequestError, match="allowed_tools names 'nope'") as unknown:
        client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=_allowed("auto", "nope")
        )
    assert unknown.value.body["param"] == "tool_choice"
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=_allowed("sometimes", "book")
        )
    assert len(backend.requests) == requests


WHOLE_CALL = '{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>"


@pytest.mark.parametrize(
    ("answer", "whole"),
    [
        (WHOLE_CALL + '\n<tool_call>\n{"', 1),
        ('{"name": "get_weather", "arguments": {"city": "Os', 0),
    ],
    ids=["second-call-cut", "only-call-cut"],
)
def test_a_call_cut_by_the_budget_is_neither_content_nor_hidden(
    smollm2_tokenizer, answer: str, whole: int
) -> None:
    """tool_choice required, and the budget cuts a call (after a whole one, or the
    first). Whole calls come back, the cut one is not content (its markup is never
    shown as text), and every API says the budget ended the answer (chat "length",
    Anthropic "max_tokens", Responses incomplete)."""
    ids = tuple(smollm2_tokenizer.encode(answer, add_special_tokens=False))
    backend = ScriptedBackend([TokenEvent(ids, "length")])
    with live_server(backend, smollm2_tokenizer) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=len(ids)
        )
        chunks = list(
            client.chat.completions.create(
                model=MODEL_ID,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=len(ids),
                stream=True,
            )
        )
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        anthropic = httpx.post(
            url + "/v1/messages",
            json={
                "model": MODEL_ID,
                "max_tokens": len(ids),
                "messages": ASK,
                "tools": [tool],
                "tool_choice": {"type": "any"},
            },
            timeout=30,
        ).json()
        responses = httpx.post(
            url + "/v1/responses",
            json={
                "model": MODEL_ID,
                "input": ASK[0]["content"],
                "tools": [{"type": "function", **WEATHER["function"]}],
                "tool_choice": "required",
                "max_output_tokens": len(ids),
            },
            timeout=30,
        ).json()
        streamed_texts = []
        for path, body in (
            (
                "/v1/messages",
                {
                    "model": MODEL_ID,
                    "max_tokens": len(ids),
                    "messages": ASK,
                    "tools": [tool],
                    "tool_choice": {"type": "any"},
                },
            ),
            (
                "/v1/responses",
                {
                    "model": MODEL_ID,
                    "input": ASK[0]["content"],
                    "tools": [{"type": "function", **WEATHER["function"]}],
                    "tool_choice": "required",
                    "max_output_tokens": len(ids),
                },
            ),
        ):
            events = httpx.post(url + path, json={**body, "stream": True}, timeout=30).text
            streamed_texts += [
                json.loads(line[5:]) for line in events.splitlines() if line.startswith("data:")
            ]
    # Neither streamed API shows call markup as text.
    text_deltas = [
        e
        for e in streamed_texts
        if e.get("type") == "response.output_text.delta"
        or (e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta")
    ]
    assert not [e for e in text_deltas if "city" in json.dumps(e)], text_deltas
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == whole
    for call in calls:
        assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    streamed = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(streamed) == whole
    assert anthropic["stop_reason"] == "max_tokens"
    assert [b["type"] for b in anthropic["content"]] == ["tool_use"] * whole
    assert responses["status"] == "incomplete"
    assert [item["type"] for item in responses["output"]] == ["function_call"] * whole


def test_a_function_without_parameters_is_called_with_an_empty_object(
    smollm2_grammars, smollm2_tokenizer
) -> None:
    """OpenAI reads a function with no ``parameters`` as one of no parameters: a
    forced call of it takes ``{}`` and nothing else (not an object of any shape)."""
    ping = [{"type": "function", "function": {"name": "ping"}}]
    spec = grammar_spec("grammar", forced_call_grammar(ToolFormat.HERMES, "ping", ping, False))
    assert follows(smollm2_grammars, spec, smollm2_tokenizer.encode("{}")) is not None
    refused = first_refused(smollm2_grammars, spec, smollm2_tokenizer, '{"host": "a"}')
    assert refused == '{"'
    # The schema-less fallback still takes any object.
    free = forced_call_grammar(ToolFormat.HERMES, "ping", ping, False, schemas=False)
    ids = smollm2_tokenizer.encode('{"host": "a"}')
    assert follows(smollm2_grammars, grammar_spec("grammar", free), ids) is not None


def test_a_streamed_answer_of_calls_alone_has_no_content(frontend) -> None:
    """Streamed with tools, the first delta's content is null (OpenAI's, for calls):
    the SDK's stream helper then ends with content None, as the same answer
    unstreamed has, not ""."""
    client, _ = frontend
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(
        model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=named
    ) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content is None and message.tool_calls[0].function.name == "get_weather"
