"""Chat request parts (pydantic, strict types, as in schemas.py): messages and their
content parts, tools, tool choices and the tool calls a conversation sends back."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, model_validator

from stage.frontend.schemas_base import Bool, Str, _Body


class ContentPart(_Body):
    type: Str
    text: Str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported; only 'text'")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self


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
        return "\n".join(part.text or "" for part in self.content)

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
