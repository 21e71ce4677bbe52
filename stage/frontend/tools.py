"""Tool calling: tools into the prompt, tool calls out of the text.

The served format is the Hermes one (Qwen2, Qwen3, SmolLM and many fine-tunes): the
model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
and reads results in ``tool`` messages. Two ways in:

- the model's chat template renders ``tools`` itself and knows ``<tool_call>``
  (``TemplateTools.NATIVE``): messages, tools, assistant ``tool_calls`` and ``tool``
  messages go to ``apply_chat_template`` as transformers documents them;
- the template ignores ``tools`` (``TemplateTools.GENERIC``, e.g. SmolLM2-135M's):
  the tools and the format are described in a system message, assistant calls are
  written into the assistant text as the model is asked to write them, and tool
  results come back as user messages wrapped in ``<tool_response>``.

Templates that render tools for Llama 3.x JSON calls, Mistral's ``[TOOL_CALLS]``, or
Qwen3-Coder's and GLM-4.5's XML calls are native too, with their own formats
(``stage/frontend/tool_formats.py``); a
template that renders tools in a format none of these is refused with a 400.

``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` lets the
model choose; ``required`` starts the answer with ``<tool_call>``; a named function
starts it with that call's name, so the model can only fill in the arguments. For
both, a grammar holds the rest of the answer to well-formed calls whose arguments
follow the functions' schemas (``tool_formats.forced_call_grammar``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


class TemplateTools(Enum):
    NATIVE = "native"
    GENERIC = "generic"
    OTHER = "other"


def template_tools(template: str | None) -> TemplateTools:
    """How a chat template handles tools (see the module docstring)."""
    text = template or ""
    known = (CALL_OPEN, "[TOOL_CALLS]", "<|python_tag|>", "ipython")
    if "tools" in text and any(mark in text for mark in known):
        return TemplateTools.NATIVE
    if "tools" in text or "[TOOL_CALLS]" in text:
        return TemplateTools.OTHER
    return TemplateTools.GENERIC


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            body["index"] = index
        return body


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_prefix(choice: str | None) -> str:
    """Text the answer starts with for ``tool_choice``: ``required`` (any call) or a
    function name (that call); '' otherwise."""
    if choice == "required":
        return CALL_OPEN + "\n"
    if choice and choice not in ("auto", "none"):
        return CALL_OPEN + "\n" + json.dumps({"name": choice})[:-1] + ', "arguments": '
    return ""


def generic_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """The system message that describes ``tools`` to a model whose template does
    not render them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to help with the user's request. The "
        "functions you can call are listed as JSON schemas inside <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments inside "
        "<tool_call></tool_call> tags, one call per pair of tags:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
        "</tool_call>\nResults come back inside <tool_response></tool_response>."
    )


def generic_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` for a template that knows nothing of tools: the tools described
    in the (first) system message, assistant calls written as text, tool results as
    user messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                CALL_OPEN
                + "\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n"
                + CALL_CLOSE
                for c in message["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            out.append({"role": "user", "content": text})
        else:
            out.append({"role": role, "content": content})
    if tools:
        described = generic_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def parse_tool_calls(
    text: str, known: Sequence[str], parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """Split a generated answer into its text and its tool calls.

    Every ``<tool_call>...</tool_call>`` block (the last one may be cut off by the
    end of the answer, its closing tag too) holding a JSON object with a known
    function ``name`` and ``arguments`` (an object, or JSON text of one) becomes a
    call; anything else stays text. The block's JSON is read as JSON, so a string
    in the arguments may hold ``</tool_call>`` itself. Without ``parallel`` only the
    first call is kept."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for start, end, body in _call_blocks(text):
        call = _call_of(body, known)
        if call is None or (calls and not parallel):
            continue
        kept.append(text[at:start])
        at = end
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call_blocks(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, body)`` of each ``<tool_call>`` block of ``text``: a JSON value
    after the tag, then its closing tag (or the end of the text, or a part of the
    tag the text ends in); where no JSON value is there, up to the next closing tag
    (or the end) as the model wrote it."""
    blocks: list[tuple[int, int, str]] = []
    decoder = json.JSONDecoder()
    at = text.find(CALL_OPEN)
    while at >= 0:
        inner = at + len(CALL_OPEN)
        value_at = _skip_space(text, inner)
        try:
            _, value_end = decoder.raw_decode(text, value_at)
        except ValueError:
            value_end = -1
        if value_end >= 0:
            after = _skip_space(text, value_end)
            tail = text[after : after + len(CALL_CLOSE)]
            if tail == CALL_CLOSE or (
                after + len(tail) == len(text) and CALL_CLOSE.startswith(tail)
            ):
                end = after + len(tail)
                blocks.append((at, end, text[value_at:value_end]))
                at = text.find(CALL_OPEN, end)
                continue
        match = _CALL.match(text, at)
        assert match is not None  # _CALL matches from any CALL_OPEN
        blocks.append((at, match.end(), match.group(1)))
        at = text.find(CALL_OPEN, match.end())
    return blocks


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _call_of(body: str, known: Sequence[str]) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    return call_from_value(value, known, new_call_id())


def call_from_value(value: Any, known: Sequence[str], call_id: str) -> ToolCall | None:
    """A call from a decoded JSON value: an object with a known function ``name`` and
    ``arguments`` (or Llama's ``parameters``): an object, or JSON text of one."""
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(value["name"]), json.dumps(arguments, ensure_ascii=False), call_id)


def held_from(text: str, mark: str = CALL_OPEN) -> int:
    """Where streamed text must stop being sent as content: the start of a tool
    call, or of what may still become one (a prefix of ``mark``, ``<tool_call>`` by
    default, at the end); ``len(text)`` when none."""
    found = text.find(mark)
    if found >= 0:
        return found
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:size]):
            return len(text) - size
    return len(text)
