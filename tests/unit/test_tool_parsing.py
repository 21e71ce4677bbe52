"""Tool calls: parsing the Hermes format, the streamed hold-back, and prompts for
templates that render tools and templates that do not."""

from __future__ import annotations

import json

import pytest

from stage.frontend.tools import (
    CALL_CLOSE,
    TemplateTools,
    forced_prefix,
    generic_messages,
    held_from,
    parse_tool_calls,
    template_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_calls_are_parsed_and_the_rest_is_text() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, ["get_weather", "get_time"])
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    content, calls = parse_tool_calls(text, ["get_weather", "get_time"], parallel=False)
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    ],
)
def test_what_is_not_a_valid_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, ["get_weather"]) == (text, [])


def test_an_answer_cut_after_a_complete_call_keeps_it() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    content, calls = parse_tool_calls(text, ["get_weather"])
    assert content is None and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_a_closing_tag_cut_by_the_end_of_the_answer_is_not_left_as_text() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for cut in ("\n</tool_", "\n</", "\n"):
        content, calls = parse_tool_calls(
            call + "\n" + call[: -len(CALL_CLOSE)] + cut, ["get_weather"]
        )
        assert content is None and len(calls) == 2, cut


def test_a_string_in_the_arguments_may_hold_the_closing_tag() -> None:
    arguments = {"x": "a</tool_call> b <tool_call>", "y": ["}}", "</tool_call>"]}
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    text = f"Sure.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_tool_calls(text, ["get_weather"])
    assert content == "Sure."
    assert [json.loads(c.arguments) for c in calls] == [arguments, arguments]
    # JSON followed by more than the closing tag is read as the model wrote it.
    odd = f"<tool_call>{call} trailing</tool_call>"
    assert parse_tool_calls(odd, ["get_weather"]) == (odd, [])


def test_streamed_text_is_held_from_a_possible_call_on() -> None:
    assert held_from("plain text") == len("plain text")
    assert held_from("text <tool") == len("text ")
    assert held_from("text <tool_call>{") == len("text ")
    assert held_from("a < b") == len("a < b")


def test_templates_are_told_apart() -> None:
    assert template_tools(None) is TemplateTools.GENERIC
    assert template_tools("{% for m in messages %}{{ m.content }}{% endfor %}") is (
        TemplateTools.GENERIC
    )
    native = "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>"
    assert template_tools(native) is TemplateTools.NATIVE
    assert template_tools("{% if tools %}<function_calls>{% endif %}") is TemplateTools.OTHER


def test_generic_messages_describe_tools_and_replay_calls_as_text() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = generic_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"get_weather"' in out[0]["content"]
    content, calls = parse_tool_calls(out[2]["content"], ["get_weather"])
    assert content is None and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


def test_forced_prefixes() -> None:
    assert forced_prefix("auto") == "" and forced_prefix("none") == ""
    assert forced_prefix("required") == "<tool_call>\n"
    named = forced_prefix("get_weather")
    completed = named + '{"city": "Rome"}}\n</tool_call>'
    content, calls = parse_tool_calls(completed, ["get_weather"])
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
