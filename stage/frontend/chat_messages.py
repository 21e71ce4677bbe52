"""Chat request parts (pydantic, strict types, as in schemas.py): messages and their
content parts, tools, tool choices and the tool calls a conversation sends back."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, model_validator

from stage.frontend.schemas_base import Bool, Str, _Body


class ContentPart(_Body):
    """A text part, or (in an assistant message sent back) a refusal part, whose
    words are the turn's text as the model wrote them."""

    type: Str
    text: Str | None = None
    refusal: Str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type == "refusal":
            if self.refusal is None:
                raise ValueError("a 'refusal' content part needs a 'refusal' string")
            return self
        if self.type != "text":
            raise ValueError(
                f"content part type {self.type!r} is not supported; only 'text' (and "
                "'refusal' in assistant messages)"
            )
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self

    @property
    def words(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


FunctionName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(_Body):
    name: FunctionName
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates expect it (OpenAI's shape, unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1, max_length=128)]


class AllowedToolsChoice(_Body):
    """OpenAI's ``allowed_tools`` tool_choice: of ``tools``, only these are offered
    (and may be called), with ``mode`` auto or required."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class CalledFunction(_Body):
    name: FunctionName
    arguments: Str


class ToolCallIn(_Body):
    """A call of an earlier assistant turn, sent back by the client."""

    id: Annotated[str, Strict(), Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[ContentPart] | None = None
    name: Annotated[str, Strict(), Field(max_length=256)] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Annotated[str, Strict(), Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs 'content'")
        if isinstance(self.content, list) and not self.content:
            # As OpenAI: an empty list is no content (a string may be empty).
            raise ValueError("'content' is an empty list; send at least one content part")
        if self.role != "assistant" and isinstance(self.content, list):
            if any(part.type == "refusal" for part in self.content):
                raise ValueError("only an 'assistant' message may hold a 'refusal' part")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError(
                "a 'tool' message needs 'tool_call_id': the id of the assistant's tool "
                "call it answers"
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.words for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it; 'developer' is a system
        message; a call's arguments become an object where they parse as one (how
        templates render them)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def tool_message_problem(messages: list[ChatMessage]) -> str | None:
    """What is wrong with the conversation's tool calls and results, as OpenAI checks
    them (None when nothing is): every 'tool' message answers a call of the
    assistant message before its run of tool messages, by that call's id; a call id
    appears once in an assistant message; and every call is answered before the
    next message that is not a tool result, and before the conversation ends. Calls
    sent without ids (some clients drop them) are matched by position only: their
    results need just to follow."""
    calls: list[str | None] | None = None  # the open assistant message's call ids
    opened = -1
    answered: set[str] = set()

    def unanswered() -> list[str]:
        return [c for c in calls or () if c is not None and c not in answered]

    for index, message in enumerate(messages):
        if message.role == "tool":
            if calls is None:
                return (
                    f"message {index} is a 'tool' message, but the message before its run of "
                    "tool results is not an assistant message with tool_calls; send the "
                    "assistant's calls before their results"
                )
            known = [c for c in calls if c is not None]
            if len(known) == len(calls) and message.tool_call_id not in known:
                return (
                    f"message {index} answers tool_call_id {message.tool_call_id!r}, which is "
                    f"not a call of message {opened} (its calls: {', '.join(known)})"
                )
            answered.add(message.tool_call_id or "")
            continue
        if unanswered():
            return (
                f"message {opened} called {', '.join(unanswered())} but no 'tool' message "
                f"answers it before message {index}; send each call's result as a 'tool' "
                "message with its tool_call_id"
            )
        calls, answered = None, set()
        if message.role == "assistant" and message.tool_calls:
            calls = [call.id for call in message.tool_calls]
            known = [c for c in calls if c is not None]
            if len(set(known)) != len(known):
                return f"message {index} has two tool calls with one id; give each its own"
            opened = index
    if unanswered():
        return (
            f"message {opened} called {', '.join(unanswered())} but the conversation ends "
            "before a 'tool' message answers it; send each call's result as a 'tool' message "
            "with its tool_call_id"
        )
    return None
