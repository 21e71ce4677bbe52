"""Anthropic's Messages API (``POST /v1/messages``) over the same generation path.

A request is translated into a chat completion body (system prompt, text, tool use
and tool results become OpenAI-style messages and tools; thinking blocks sent back
are dropped; ``thinking`` reaches the chat template as ``enable_thinking``; a final
assistant message is continued, as Anthropic's prefill),
prepared and run exactly as ``/v1/chat/completions`` would run it; the answer is
written back as a Messages API ``message`` or its events (anthropic_answer.py).

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the prompt tokens
``/v1/messages`` would read for the same body (``max_tokens`` may be left out).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from stage.frontend.errors import OpenAIError, from_validation_error
from stage.frontend.prepare import PromptContext, checked_chat_prompt
from stage.frontend.schemas import ChatCompletionBody

Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]

# Request fields that do not change what is generated: accepted and ignored.
IGNORED_FIELDS = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",
        "container",
        "diagnostics",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: Str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Str
    name: Str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Str
    content: Str | list[TextBlock] = ""
    is_error: Bool | None = None

    def text(self) -> str:
        body = (
            self.content
            if isinstance(self.content, str)
            else "\n".join(b.text for b in self.content)
        )
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Body):
    """An earlier answer's thought, sent back by clients: not shown to the model again
    (reasoning models' templates drop earlier thoughts too)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Str | list[Block]


class Tool(_Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"server tool {kind!r} is not supported: this server runs only client tools "
                "(a name, a description and an input_schema), which the client executes"
            )
        return value


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Str | None = None
    disable_parallel_tool_use: Bool | None = None


class MessagesBody(BaseModel):
    """The Messages API request. Unknown top-level fields are refused, as on the
    OpenAI endpoints, except those that change nothing (``IGNORED_FIELDS``) and
    ``thinking`` when disabled."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)

    model: Annotated[str, Strict(), Field(min_length=1, max_length=512)] | None = None
    max_tokens: Annotated[int, Strict(), Field(ge=1, le=2**31 - 1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Str | list[TextBlock] | None = None
    stop_sequences: list[Str] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=0)] | None = None
    stream: Bool | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None

    def chat_body(self, model_id: str) -> dict[str, Any]:
        """The same request as a chat completion body."""
        extra = dict(self.model_extra or {})
        thinking = extra.pop("thinking", None)
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if thinking is not None and kind not in ("enabled", "disabled"):
            raise OpenAIError(400, "thinking must be {'type': 'enabled' | 'disabled', ...}")
        unknown = sorted(set(extra) - IGNORED_FIELDS)
        if unknown:
            raise OpenAIError(
                400, f"unknown parameter '{unknown[0]}'; this server does not support it"
            )
        messages: list[dict[str, Any]] = []
        if self.system:
            system = (
                self.system
                if isinstance(self.system, str)
                else "\n".join(b.text for b in self.system)
            )
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _chat_messages(message)
        body: dict[str, Any] = {
            "model": self.model or model_id,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": bool(self.stream),
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if all(m["role"] == "system" for m in messages):
            raise OpenAIError(
                400,
                "messages hold no content to answer: each message needs at least one "
                "text, image, tool_use or tool_result block",
            )
        last = messages[-1]
        if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
            # A final assistant message is a prefill: the answer continues it.
            if last["content"] != last["content"].rstrip():
                raise OpenAIError(
                    400, "final assistant content cannot end with trailing whitespace"
                )
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        for name in ("top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if kind is not None:
            # Reasoning models' templates that can skip the thought read this (Qwen3's);
            # the others think as they always do (budget_tokens is not enforced).
            body["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in self.tools
            ]
            choice = self.tool_choice
            if choice is not None:
                if choice.type == "tool":
                    if not choice.name:
                        raise OpenAIError(400, "tool_choice of type 'tool' needs a name")
                    body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
                else:
                    body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                        choice.type
                    ]
                if choice.disable_parallel_tool_use:
                    body["parallel_tool_calls"] = False
        elif self.tool_choice is not None:
            raise OpenAIError(400, "tool_choice is only allowed with tools")
        return body


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if message.role == "assistant":
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        if any(isinstance(b, ToolResultBlock) for b in message.content):
            raise OpenAIError(400, "tool_result blocks belong in user messages")
        entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    if any(isinstance(b, ToolUseBlock) for b in message.content):
        raise OpenAIError(400, "tool_use blocks belong in assistant messages")
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def parse_body(payload: dict[str, Any], model_id: str) -> tuple[MessagesBody, ChatCompletionBody]:
    """The Messages request and its chat completion twin; OpenAIError (400) when
    either is invalid."""
    try:
        body = MessagesBody.model_validate(payload)
        chat = ChatCompletionBody.model_validate(body.chat_body(model_id))
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    return body, chat


async def count_tokens(payload: dict[str, Any], ctx: PromptContext) -> dict[str, int]:
    """The answer of ``POST /v1/messages/count_tokens`` for the JSON object ``payload``."""
    _, chat = parse_body({"max_tokens": 1, **payload}, ctx.model_id)
    return {"input_tokens": len(await checked_chat_prompt(chat, ctx))}
