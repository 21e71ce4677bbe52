"""Anthropic's Messages API (``POST /v1/messages``) over the same generation path.

A request is translated into a chat completion body (system prompt, text, tool use
and tool results become OpenAI-style messages and tools), prepared and run exactly
as ``/v1/chat/completions`` would run it, and the answer is written back as a
Messages API ``message``: content blocks (``text``, ``tool_use``), ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and ``usage``;
streamed as its server-sent events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). Errors use its shape
``{"type": "error", "error": {"type", "message"}}``.

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the prompt tokens
``/v1/messages`` would read for the same body (``max_tokens`` may be left out).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from mesh.errors import MeshError
from stage.frontend.errors import OpenAIError, from_mesh_error, from_validation_error
from stage.frontend.generation import GenerationRun
from stage.frontend.prepare import PromptContext, checked_chat_prompt
from stage.frontend.schemas import ChatCompletionBody
from stage.frontend.tool_formats import ToolUse

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
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


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


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Str | list[Block]


class Tool(_Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Str | None = None
    input_schema: dict[str, Any]


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
        if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
            raise OpenAIError(400, "extended thinking is not supported; omit 'thinking'")
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
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "stream": bool(self.stream),
        }
        for name in ("top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
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


@dataclass(frozen=True)
class MessageShape:
    """A run's answer as a Messages API ``message``, or as its stream (see
    stage/frontend/translated.py)."""

    message_id: str
    model: str

    def body(self, run: GenerationRun, text: str) -> dict[str, Any]:
        blocks, called = content_blocks(text, run.prepared.tools)
        stop_reason, stop_sequence = stop_of(run.finish_reason, run.stop_string, called)
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": _input_tokens(run),
                "cache_read_input_tokens": run.cached_tokens,
                "cache_creation_input_tokens": 0,
                "output_tokens": run.completion_tokens,
            },
        }

    def events(self, run: GenerationRun, texts: AsyncIterator[str]) -> AsyncIterator[bytes]:
        def finish() -> tuple[str | None, str | None, int]:
            return run.finish_reason, run.stop_string, run.completion_tokens

        return message_events(
            texts,
            finish,
            self.message_id,
            self.model,
            (_input_tokens(run), run.cached_tokens),
            run.prepared.tools,
        )


def _input_tokens(run: GenerationRun) -> int:
    """Anthropic counts the prompt tokens read from a cache apart from the others."""
    return len(run.request.prompt_tokens) - run.cached_tokens


def error_response_body(error: OpenAIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def content_blocks(text: str, tools: ToolUse | None) -> tuple[list[dict[str, Any]], bool]:
    """The answer's content blocks (``text`` after the tools' prefix), and whether it
    called a tool."""
    prefix = tools.prefix if tools is not None else ""
    content, calls = tools.parse(prefix + text) if tools is not None else (text, [])
    blocks: list[dict[str, Any]] = []
    if not calls:
        content = prefix + text
    if content:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call.id.removeprefix("call_"),
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return blocks, bool(calls)


def stop_of(finish: str | None, stop_string: str | None, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if finish == "stop" and stop_string is not None:
        return "stop_sequence", stop_string
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


async def message_events(
    texts: AsyncIterator[str],
    finish: Any,
    message_id: str,
    model: str,
    input_tokens: tuple[int, int],
    tools: ToolUse | None,
) -> AsyncIterator[bytes]:
    """The Messages API stream of an answer whose text pieces come from ``texts``;
    ``finish()`` gives (finish reason, stop string, output tokens) once it ended;
    ``input_tokens``: (prompt tokens read, prompt tokens taken from the prefix cache).
    Text from (what may become) a tool call on is held back and sent, at the end, as
    ``tool_use`` blocks."""
    usage = {
        "input_tokens": input_tokens[0],
        "cache_read_input_tokens": input_tokens[1],
        "cache_creation_input_tokens": 0,
        "output_tokens": 0,
    }
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    yield sse_event("message_start", {"message": start})
    index, text_open = 0, False
    answer, released = (tools.prefix if tools is not None else ""), 0
    pieces = texts.__aiter__()
    while True:
        try:
            piece = await pieces.__anext__()
        except StopAsyncIteration:
            break
        except MeshError as exc:
            # The stream ends with Anthropic's error event (the status is sent already).
            error = error_response_body(from_mesh_error(exc, 1))
            yield sse_event("error", {"error": error["error"]})
            return
        if tools is not None:
            answer += piece
            cut = max(released, tools.hold_start(answer))
            piece, released = answer[released:cut], cut
        if not piece:
            continue
        if not text_open:
            block = {"type": "text", "text": ""}
            yield sse_event("content_block_start", {"index": index, "content_block": block})
            text_open = True
        delta = {"type": "text_delta", "text": piece}
        yield sse_event("content_block_delta", {"index": index, "delta": delta})
    reason, stop_string, output_tokens = finish()
    # The held text (a tool was given: ``answer`` is empty otherwise).
    held = answer[released:]
    blocks, called = ([], False)
    if tools is not None and held:
        blocks, called = content_blocks(held, replace(tools, prefix=""))
    for block in blocks:
        if block["type"] == "text":
            if not text_open:
                start_block = {"type": "text", "text": ""}
                yield sse_event(
                    "content_block_start", {"index": index, "content_block": start_block}
                )
                text_open = True
            delta = {"type": "text_delta", "text": block["text"]}
            yield sse_event("content_block_delta", {"index": index, "delta": delta})
            continue
        if text_open:
            yield sse_event("content_block_stop", {"index": index})
            text_open, index = False, index + 1
        opened = {**block, "input": {}}
        yield sse_event("content_block_start", {"index": index, "content_block": opened})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield sse_event("content_block_delta", {"index": index, "delta": delta})
        yield sse_event("content_block_stop", {"index": index})
        index += 1
    if text_open:
        yield sse_event("content_block_stop", {"index": index})
    stop_reason, stop_sequence = stop_of(reason, stop_string, called)
    yield sse_event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        },
    )
    yield sse_event("message_stop", {})
