"""Tool calls written as XML (stage/frontend/xml_tools.py): Qwen3-Coder's and
GLM-4.5's formats, values typed by the functions' schemas, text around calls,
malformed and cut-off blocks, forced starts."""

from __future__ import annotations

import json

import pytest

from stage.frontend.tool_formats import ToolFormat, forced_call_grammar, forced_prefix
from stage.frontend.xml_tools import XmlStyle, param_types, parse_xml_calls, typed_value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "dry_run": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object"},
                    "mode": {"enum": ["a", "b"]},
                    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
TYPES = param_types(TOOLS)
KNOWN = ["edit", "ping"]
ARGS = {
    "path": "src/a b.py",
    "line": 12,
    "ratio": 0.5,
    "dry_run": True,
    "tags": ["x", "y"],
    "options": {"k": [1, 2]},
    "mode": "a",
    "maybe": None,
}


def qwen_call(name: str, arguments: dict) -> str:
    """A call as Qwen3-Coder's template writes one."""
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm_call(name: str, arguments: dict) -> str:
    """A call as GLM-4.5's template writes one."""
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
        "</arg_value>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


WRITERS = {XmlStyle.QWEN: qwen_call, XmlStyle.GLM: glm_call}


@pytest.mark.parametrize("style", list(XmlStyle))
def test_calls_are_parsed_with_their_values_typed_by_the_schema(style: XmlStyle) -> None:
    write = WRITERS[style]
    text = "Let me look.\n" + write("edit", ARGS) + "\n" + write("ping", {})
    content, calls = parse_xml_calls(style, text, KNOWN, True, TYPES)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["edit", "ping"]
    assert json.loads(calls[0].arguments) == ARGS
    assert json.loads(calls[1].arguments) == {}
    assert calls[0].id != calls[1].id
    _, first = parse_xml_calls(style, text, KNOWN, False, TYPES)
    assert [c.name for c in first] == ["edit"]


@pytest.mark.parametrize("style", list(XmlStyle))
def test_what_is_not_a_whole_call_of_a_known_function_stays_text(style: XmlStyle) -> None:
    write = WRITERS[style]
    unknown = write("delete_everything", {"path": "/"})
    cut = write("edit", {"path": "a.py"})[:-20]
    for text in (unknown, cut, "No call here.", "<tool_call></tool_call>"):
        assert parse_xml_calls(style, text, KNOWN, True, TYPES) == (text, [])


def test_multiline_string_values_keep_their_text() -> None:
    code = "def f():\n    return '<b>'\n"
    text = qwen_call("edit", {"path": code})
    _, (call,) = parse_xml_calls(XmlStyle.QWEN, text, KNOWN, True, TYPES)
    assert json.loads(call.arguments) == {"path": code}


def test_values_that_do_not_read_as_their_type_stay_text() -> None:
    integer = ("integer",)
    assert typed_value("12", integer) == 12
    assert typed_value("twelve", integer) == "twelve"
    assert typed_value("1.5", integer) == "1.5"
    assert typed_value("true", ("boolean",)) is True
    assert typed_value("[1]", ("object",)) == "[1]"
    assert typed_value("12", ("string",)) == "12"
    # Untyped: JSON where it reads as JSON, else text.
    assert typed_value('{"a": 1}', ()) == {"a": 1} and typed_value("hello", ()) == "hello"


def test_a_forced_choice_starts_the_call_and_leaves_the_rest_free() -> None:
    assert forced_prefix(ToolFormat.QWEN_XML, "required") == "<tool_call>\n<function="
    assert forced_prefix(ToolFormat.QWEN_XML, "edit") == "<tool_call>\n<function=edit>\n"
    assert forced_prefix(ToolFormat.GLM_XML, "required") == "<tool_call>"
    assert forced_prefix(ToolFormat.GLM_XML, "edit") == "<tool_call>edit\n"
    assert forced_prefix(ToolFormat.GLM_XML, "auto") == ""
    for fmt in (ToolFormat.QWEN_XML, ToolFormat.GLM_XML):
        assert forced_call_grammar(fmt, "required", TOOLS) == ""
    # A forced start and the model's rest parse as one call.
    prefix = forced_prefix(ToolFormat.QWEN_XML, "edit")
    rest = qwen_call("edit", {"line": 3})[len(prefix) :]
    _, (call,) = parse_xml_calls(XmlStyle.QWEN, prefix + rest, KNOWN, True, TYPES)
    assert json.loads(call.arguments) == {"line": 3}


def test_glm_calls_written_without_line_breaks_are_read() -> None:
    """GLM-4.7's template writes a call on one line."""
    text = "<tool_call>edit<arg_key>path</arg_key><arg_value>a.py</arg_value>"
    text += "<arg_key>line</arg_key><arg_value>7</arg_value></tool_call>"
    content, (call,) = parse_xml_calls(XmlStyle.GLM, text, KNOWN, True, TYPES)
    assert content is None and call.name == "edit"
    assert json.loads(call.arguments) == {"path": "a.py", "line": 7}
