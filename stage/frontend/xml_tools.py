"""Tool calls written as XML: Qwen3-Coder's and GLM-4.5's formats.

Both wrap each call in ``<tool_call>`` ... ``</tool_call>`` like the Hermes format,
but write its arguments as tagged text rather than JSON:

- Qwen3-Coder (``QWEN``)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- GLM-4.5 / 4.6 (``GLM``)::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

A value is the text between its tags (Qwen3-Coder's without the newline after the
opening tag and before the closing one). Their templates write string arguments
as they are and others as JSON, so a value becomes the type its function's
``parameters`` schema gives it (``typed_value``): text for strings, JSON (an
integer, number, boolean, object, array or null) where the schema says so and the
text reads as that; a parameter the schema does not describe is JSON where the
text parses as JSON, else text. A block that does not name a known function or
is cut off before its end stays text, as a malformed Hermes block does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from stage.frontend.tools import CALL_CLOSE, CALL_OPEN, ToolCall, new_call_id


class XmlStyle(Enum):
    QWEN = "qwen3_coder"
    GLM = "glm45"


# (function, parameter) -> the JSON types its schema allows.
ParamTypes = Mapping[tuple[str, str], tuple[str, ...]]

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_GLM_NAME = re.compile(r"\s*([^\s<]+)\s*")
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def param_types(tools: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], tuple[str, ...]]:
    """The JSON types each function's ``parameters`` schema allows each of its
    properties (``type``, a list of types, or the types of ``anyOf`` / ``oneOf``
    branches); a property without a type is left out."""
    found: dict[tuple[str, str], tuple[str, ...]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if not isinstance(properties, Mapping):
            continue
        for name, schema in properties.items():
            types = _schema_types(schema)
            if types:
                found[(str(function.get("name")), str(name))] = types
    return found


def _schema_types(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, Mapping):
        return ()
    kind = schema.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list):
        return tuple(str(k) for k in kind)
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return ("string",)
    branches = schema.get("anyOf") or schema.get("oneOf") or []
    return tuple(dict.fromkeys(t for branch in branches for t in _schema_types(branch)))


def typed_value(text: str, types: tuple[str, ...]) -> Any:
    """``text`` as the value of a parameter whose schema allows ``types`` (see the
    module docstring)."""
    if types and types[0] == "string":
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if not types or _fits(value, types):
        return value
    return text


def _fits(value: Any, types: tuple[str, ...]) -> bool:
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return any(checks.get(kind, lambda v: False)(value) for kind in types)


def parse_xml_calls(
    style: XmlStyle,
    text: str,
    known: Sequence[str],
    parallel: bool = True,
    types: ParamTypes | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """The answer's text (None when it is only calls) and its tool calls."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        call = _call(style, match.group(1), known, types or {})
        if call is None or (calls and not parallel):
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call(style: XmlStyle, body: str, known: Sequence[str], types: ParamTypes) -> ToolCall | None:
    if style is XmlStyle.QWEN:
        match = _QWEN_FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        pairs = [(key.strip(), _trim(value)) for key, value in _QWEN_PARAMETER.findall(inner)]
        rest = _QWEN_PARAMETER.sub("", inner)
    else:
        match = _GLM_NAME.match(body)
        if match is None:
            return None
        name, inner = match.group(1), body[match.end() :]
        pairs = [(key.strip(), value) for key, value in _GLM_PAIR.findall(inner)]
        rest = _GLM_PAIR.sub("", inner)
    if name not in known or rest.strip():
        return None
    arguments = {key: typed_value(value, types.get((name, key), ())) for key, value in pairs}
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


def _trim(value: str) -> str:
    """A Qwen3-Coder value without the newline its tags put around it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def forced_prefix(style: XmlStyle, choice: str | None) -> str:
    """What the answer starts with for ``tool_choice`` ``required`` (any call) or a
    function name (that call); '' otherwise."""
    if choice in (None, "auto", "none"):
        return ""
    if style is XmlStyle.QWEN:
        head = CALL_OPEN + "\n<function="
        return head if choice == "required" else head + choice + ">\n"
    return CALL_OPEN if choice == "required" else CALL_OPEN + choice + "\n"
