"""The tool-call formats models write, and what the frontend does with each.

- ``HERMES``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  anywhere in the answer (Qwen2, Qwen3, SmolLM, Hermes fine-tunes; and every model
  whose template does not render tools, told so in a system message).
- ``LLAMA3_JSON``: the whole answer is a JSON call ``{"name": ..., "parameters":
  {...}}`` (Llama 3.1-3.3 templates; the ``<|python_tag|>`` that may start it is a
  special token, gone from the decoded text); several calls may follow one another,
  separated by ``;``.
- ``MISTRAL``: the answer is ``[TOOL_CALLS]`` and a JSON list of ``{"name": ...,
  "arguments": {...}}`` (Mistral templates that mark calls with ``[TOOL_CALLS]``);
  Mistral's templates want call ids of 9 letters and digits.
- ``MISTRAL_ARGS``: ``[TOOL_CALLS]name[ARGS]{...}``, one such run per call (the
  templates of Mistral Small 3.2, Devstral and Magistral, tokenizers v11 and
  later; a ``[CALL_ID]id`` between name and ``[ARGS]`` is read too); text before the
  first ``[TOOL_CALLS]`` is content. Its marks are special tokens, kept in the
  decoded answer (``marks_are_special``); a forced ``tool_choice`` starts the call
  and leaves the rest to the model.
- ``QWEN_XML`` (Qwen3-Coder) and ``GLM_XML`` (GLM-4.5, 4.6): ``<tool_call>`` blocks
  whose arguments are tagged text, typed by the functions' schemas
  (``stage/frontend/xml_tools.py``). A forced ``tool_choice`` starts the call; the
  rest of it is the model's (no grammar holds XML arguments to a schema).

The format comes from the model's chat template (``tool_format``). Each format
says how to parse a finished answer, from where streamed text must be held back
(``hold_start``), what the answer starts with for ``tool_choice`` ``required`` or a
named function and the grammar the rest of it then follows (``forced_call_grammar``),
and the ids of its calls.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from stage.frontend.reasoning import is_special_token
from stage.frontend.tools import CALL_CLOSE, CALL_OPEN, ToolCall, call_from_value, held_from
from stage.frontend.tools import forced_prefix as hermes_prefix
from stage.frontend.tools import parse_tool_calls as parse_hermes
from stage.frontend.xml_tools import XmlStyle, parse_xml_calls
from stage.frontend.xml_tools import forced_prefix as xml_prefix

MISTRAL_MARK = "[TOOL_CALLS]"
ARGS_MARK = "[ARGS]"
CALL_ID_MARK = "[CALL_ID]"
LLAMA_TAG = "<|python_tag|>"


class ToolFormat(Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    MISTRAL_ARGS = "mistral_args"
    QWEN_XML = "qwen3_coder"
    GLM_XML = "glm45"


_XML_STYLES = {ToolFormat.QWEN_XML: XmlStyle.QWEN, ToolFormat.GLM_XML: XmlStyle.GLM}


def tool_format(template: str | None) -> ToolFormat:
    """The format a chat template writes tool calls in (Hermes when it names none)."""
    text = template or ""
    if CALL_OPEN in text and "<function=" in text and "<parameter=" in text:
        return ToolFormat.QWEN_XML
    if CALL_OPEN in text and "<arg_key>" in text:
        return ToolFormat.GLM_XML
    if CALL_OPEN in text:
        return ToolFormat.HERMES
    if MISTRAL_MARK in text and ARGS_MARK in text:
        return ToolFormat.MISTRAL_ARGS
    if MISTRAL_MARK in text:
        return ToolFormat.MISTRAL
    if LLAMA_TAG in text or "ipython" in text:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


# The tokens of each format that mark its calls.
_MARKS = {
    ToolFormat.HERMES: (CALL_OPEN, CALL_CLOSE),
    ToolFormat.QWEN_XML: (CALL_OPEN, CALL_CLOSE),
    ToolFormat.GLM_XML: (CALL_OPEN, CALL_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>"),
    ToolFormat.LLAMA3_JSON: (LLAMA_TAG,),
    ToolFormat.MISTRAL: (MISTRAL_MARK,),
    ToolFormat.MISTRAL_ARGS: (MISTRAL_MARK, ARGS_MARK, CALL_ID_MARK),
}


def marks_are_special(tokenizer: Any, fmt: ToolFormat) -> bool:
    """Whether a tokenizer holds one of ``fmt``'s call marks as a special token, which
    decoding with special tokens skipped would leave out of the answer's text (GLM
    tokenizers mark ``<arg_key>`` so): such answers are decoded with them kept."""
    return any(is_special_token(tokenizer, mark) for mark in _MARKS[fmt])


def call_id(fmt: ToolFormat) -> str:
    if fmt in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS):
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_ids(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every call id Mistral's templates would refuse (they take 9
    letters and digits) replaced by 9 hex digits of its digest: the same for a call
    and for the result that names it."""

    def short(value: Any) -> str:
        text = "" if value is None else str(value)
        if len(text) == 9 and text.isascii() and text.isalnum():
            return text
        return hashlib.sha256(text.encode()).hexdigest()[:9]

    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "id": short(c.get("id"))} for c in message["tool_calls"]]
        if message.get("tool_call_id"):
            message["tool_call_id"] = short(message["tool_call_id"])
        out.append(message)
    return out


def forced_prefix(fmt: ToolFormat, choice: str | None) -> str:
    """What the answer starts with for ``tool_choice`` ``required`` (any call) or a
    function name (that call); '' otherwise."""
    if fmt is ToolFormat.HERMES:
        return hermes_prefix(choice)
    if fmt in _XML_STYLES:
        return xml_prefix(_XML_STYLES[fmt], choice)
    if choice in (None, "auto", "none"):
        return ""
    if fmt is ToolFormat.MISTRAL_ARGS:
        return MISTRAL_MARK if choice == "required" else MISTRAL_MARK + choice + ARGS_MARK
    head = MISTRAL_MARK + "[" if fmt is ToolFormat.MISTRAL else ""
    if choice == "required":
        return head + '{"name": "'
    key = "arguments" if fmt is ToolFormat.MISTRAL else "parameters"
    return head + json.dumps({"name": choice})[:-1] + f', "{key}": '


def hold_start(fmt: ToolFormat, text: str) -> int:
    """Where streamed text must stop being sent as content, in the answer so far:
    the start of what is or may become a call; ``len(text)`` when nothing is."""
    if fmt is ToolFormat.HERMES or fmt in _XML_STYLES:
        return held_from(text)
    if fmt is ToolFormat.MISTRAL_ARGS:
        return held_from(text, MISTRAL_MARK)
    body = text.lstrip()
    opener = "[" if fmt is ToolFormat.MISTRAL else "{"
    if not body or body.startswith(opener) or _partial(body, fmt):
        return 0
    return len(text)


def _partial(body: str, fmt: ToolFormat) -> bool:
    mark = MISTRAL_MARK if fmt is ToolFormat.MISTRAL else LLAMA_TAG
    return mark.startswith(body) or body.startswith(mark)


def parse_calls(
    fmt: ToolFormat,
    text: str,
    known: Sequence[str],
    parallel: bool = True,
    types: Mapping[tuple[str, str], tuple[str, ...]] | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """The answer's text (None when it is only calls) and its tool calls; an answer
    that is not a well-formed call of a known function is all text. ``types``: the
    JSON types of the functions' parameters, for the XML formats."""
    if fmt is ToolFormat.HERMES:
        return parse_hermes(text, known, parallel)
    if fmt in _XML_STYLES:
        return parse_xml_calls(_XML_STYLES[fmt], text, known, parallel, types)
    if fmt is ToolFormat.MISTRAL_ARGS:
        return _mistral_args_calls(text, known, parallel)
    body = text.strip()
    if fmt is ToolFormat.MISTRAL:
        values = _mistral_values(body.removeprefix(MISTRAL_MARK).strip())
    else:
        values = _llama_values(body.removeprefix(LLAMA_TAG).strip())
    if not values:
        return text, []
    calls = [call_from_value(value, known, call_id(fmt)) for value in values]
    if any(call is None for call in calls):
        return text, []
    found = [call for call in calls if call is not None]
    return None, found if parallel else found[:1]


def _mistral_args_calls(
    text: str, known: Sequence[str], parallel: bool
) -> tuple[str | None, list[ToolCall]]:
    """``[TOOL_CALLS]name[ARGS]{...}`` runs after any text: every run must be a call
    of a known function with JSON object arguments, else the whole answer is text."""
    first = text.find(MISTRAL_MARK)
    if first < 0:
        return text, []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    for run in text[first + len(MISTRAL_MARK) :].split(MISTRAL_MARK):
        name, marked, rest = run.partition(ARGS_MARK)
        name = name.split(CALL_ID_MARK, 1)[0].strip()
        rest = rest.strip()
        try:
            arguments, end = decoder.raw_decode(rest) if marked else (None, 0)
        except ValueError:
            return text, []
        if rest[end:].strip():
            return text, []
        call = call_from_value(
            {"name": name, "arguments": arguments}, known, call_id(ToolFormat.MISTRAL_ARGS)
        )
        if call is None:
            return text, []
        calls.append(call)
    content = text[:first].strip()
    return (content or None), calls if parallel else calls[:1]


def _llama_values(body: str) -> list[Any]:
    """JSON objects one after another (``;`` or whitespace between): [] unless the
    whole body is that."""
    if not body.startswith("{"):
        return []
    decoder = json.JSONDecoder()
    values, at = [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        values.append(value)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return values


def _mistral_values(body: str) -> list[Any]:
    """The JSON list of calls: [] unless the whole body is one list."""
    if not body.startswith("["):
        return []
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return []
    if body[end:].strip() or not isinstance(value, list):
        return []
    return value


# How a forced call's JSON is written (the style of the prompts and the forced
# prefixes: ``{"name": "f", "arguments": {...}}``), in llguidance's schema extension;
# ``lenient``: keywords the library does not implement (``not``, ...) are left
# unenforced rather than leaving the whole call free.
_JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
# The end of a call whose prefix reached its arguments (a named tool_choice).
_NAMED_END = {
    ToolFormat.HERMES: "}\n" + CALL_CLOSE,
    ToolFormat.LLAMA3_JSON: "}",
    ToolFormat.MISTRAL: "}]",
}


def forced_call_grammar(
    fmt: ToolFormat,
    choice: str | None,
    tools: Sequence[Any],
    parallel: bool = True,
    schemas: bool = True,
) -> str:
    """For ``tool_choice`` ``required`` or a named function, the grammar (Lark, with
    llguidance's ``%json`` for JSON that follows a schema) of the answer after
    ``forced_prefix``: well-formed calls of the request's functions (for a named
    choice, of that function) whose arguments follow each function's ``parameters``
    schema (without ``schemas``: any JSON object). '' for ``auto`` and ``none``. A
    Hermes answer may hold several calls (with ``parallel``), a Mistral one several in
    its list; a Llama answer one."""
    if choice in (None, "auto", "none") or fmt in _XML_STYLES or fmt is ToolFormat.MISTRAL_ARGS:
        return ""
    functions = [tool["function"] for tool in tools]
    if not schemas:
        functions = [{**function, "parameters": ANY_OBJECT} for function in functions]
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice]
    if not functions:
        return ""
    if choice != "required":
        schema = json.dumps(_styled(functions[0].get("parameters")))
        return f"start: args {_lit(_NAMED_END[fmt])}\nargs: %json {schema}"
    if fmt is ToolFormat.HERMES:
        close, again = _lit("\n" + CALL_CLOSE), _lit("\n" + CALL_CLOSE + "\n" + CALL_OPEN + "\n")
        calls = _hermes_calls(functions)
        if calls is None:
            return ""
        start = f"start: call ({again} call)* {close}" if parallel else f"start: call {close}"
        return f"{start}\ncall: %json {json.dumps(calls)}"
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    # The prefix ends inside the first call's name: the rest of each function's call.
    rests = []
    for index, function in enumerate(functions):
        name = json.dumps(function["name"], ensure_ascii=False)[1:]  # its closing quote too
        rests.append(f"{_lit(name + ', ' + _lit(key) + ': ')} args{index} {_lit('}')}")
    rules = [
        f"args{i}: %json {json.dumps(_styled(f.get('parameters')))}"
        for i, f in enumerate(functions)
    ]
    if fmt is ToolFormat.LLAMA3_JSON:
        return "\n".join(["start: " + " | ".join(rests), *rules])
    # Mistral: the first call's rest, maybe more whole calls, then the list's end.
    opened = _lit('{"name": "')
    more = f" ({_lit(', ')} {opened} rest)*" if parallel else ""
    return "\n".join([f"start: rest{more} {_lit(']')}", "rest: " + " | ".join(rests), *rules])


def _lit(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


# A function's arguments where its ``parameters`` are left out (or empty): as OpenAI
# reads that, a function of no parameters, called with ``{}``.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Arguments of any shape (forced calls whose schemas cannot be compiled).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _styled(schema: Any) -> dict[str, Any]:
    """A function's ``parameters`` (no parameters when absent) with the JSON style of
    a forced call."""
    base = dict(schema) if isinstance(schema, dict) and schema else NO_PARAMETERS
    return {**base, "x-guidance": _JSON_STYLE}


def _hermes_calls(functions: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The schema of one Hermes call of any of ``functions``: a name, then that
    function's arguments. Each ``parameters`` schema becomes a branch of one schema,
    so the definitions its references point at (``#/$defs/...``, as pydantic writes
    them, or ``#/definitions/...``) move to that schema's root; None where two
    functions define one name differently."""
    branches: list[dict[str, Any]] = []
    hoisted: dict[str, dict[str, Any]] = {}
    for function in functions:
        parameters = dict(function.get("parameters") or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, value in (parameters.pop(key, None) or {}).items():
                if hoisted.setdefault(key, {}).setdefault(name, value) != value:
                    return None
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return _styled({"anyOf": branches, **hoisted})


@dataclass(frozen=True)
class ToolUse:
    """What an answer is parsed for: the functions it may call, whether several
    calls are kept, the text the answer was started with (``tool_choice``) and the
    format the model writes calls in."""

    names: tuple[str, ...]
    parallel: bool
    prefix: str
    format: ToolFormat = ToolFormat.HERMES
    # The grammar spec (mesh.grammar) the answer after ``prefix`` follows for a
    # forced tool_choice; '' where the answer is free.
    grammar: str = ""
    # ((function, parameter), JSON types) of the functions' parameters (XML formats).
    types: tuple[tuple[tuple[str, str], tuple[str, ...]], ...] = ()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse_calls(self.format, text, self.names, self.parallel, dict(self.types))
        if self.grammar:
            # A forced choice's grammar lets through nothing but calls: text beside
            # them (or with no whole call at all) is a call the token budget cut
            # off, not content.
            content = None
        return content, calls

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and calls: an answer without a whole call is all
        content, except under a forced choice, where every token was (part of) a
        call: one the token budget cut off is dropped, never shown as text."""
        content, calls = self.parse(text)
        if not calls and not self.grammar:
            content = text
        return content, calls

    def hold_start(self, text: str) -> int:
        return hold_start(self.format, text)

    def repeated_call(self, text: str) -> int | None:
        """Where, in a forced answer that may hold several calls (``required`` with
        parallel calls), the first call that repeats an earlier one (the same
        function with the same arguments) starts in ``text``, the answer after
        ``prefix``; None while none does. A model held to calls may never choose to
        end them, and repeats the same one until the budget or the context runs
        out: the answer ends before the repeat. For formats whose calls end with
        ``</tool_call>``; others are held to one call or one list by their grammar."""
        if not (self.prefix and self.parallel) or self.format not in _CLOSED_FORMATS:
            return None
        whole = self.prefix + text
        seen: set[tuple[str, str]] = set()
        start = 0
        while (end := whole.find(CALL_CLOSE, start)) >= 0:
            end += len(CALL_CLOSE)
            _, calls = parse_calls(
                self.format, whole[start:end], self.names, True, dict(self.types)
            )
            for call in calls:
                key = (call.name, _canonical(call.arguments))
                if key in seen:
                    return max(0, start - len(self.prefix))
                seen.add(key)
            start = end
        return None


# Formats whose every call ends with CALL_CLOSE.
_CLOSED_FORMATS = frozenset({ToolFormat.HERMES, *_XML_STYLES})


def _canonical(arguments: str) -> str:
    """Arguments' JSON with keys sorted and spacing normalised (as written if not JSON)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments
