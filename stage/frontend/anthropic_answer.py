"""Anthropic's Messages API answers: a run's output as a ``message`` (content blocks
``thinking``, ``text``, ``tool_use``; ``stop_reason``; ``usage``) or as its
server-sent events (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``), and errors in its shape. A
reasoning model's thought (stage/frontend/reasoning.py) is a ``thinking`` block
before the answer's blocks (its ``signature`` empty: nothing here signs it)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from mesh.errors import MeshError
from stage.frontend.errors import OpenAIError, from_mesh_error
from stage.frontend.generation import GenerationRun
from stage.frontend.reasoning import split_pieces, split_reasoning
from stage.frontend.tool_formats import ToolUse

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


@dataclass(frozen=True)
class MessageShape:
    """A run's answer as a Messages API ``message``, or as its stream (see
    stage/frontend/translated.py)."""

    message_id: str
    model: str

    def body(self, run: GenerationRun, text: str) -> dict[str, Any]:
        thought = None
        if run.prepared.reasoning is not None:
            thought, text = split_reasoning(text, run.prepared.reasoning)
        blocks, called = content_blocks(text, run.prepared.tools)
        if thought:
            blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
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
            run.prepared.reasoning,
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
    content, calls = tools.split(prefix + text) if tools is not None else (text, [])
    blocks: list[dict[str, Any]] = []
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
    if called and finish != "length":
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
    reasoning: bool | None = None,
) -> AsyncIterator[bytes]:
    """The Messages API stream of an answer whose text pieces come from ``texts``;
    ``finish()`` gives (finish reason, stop string, output tokens) once it ended;
    ``input_tokens``: (prompt tokens read, prompt tokens taken from the prefix cache).
    A thought (``reasoning`` not None) streams as a ``thinking`` block first. Text
    from (what may become) a tool call on is held back and sent, at the end, as
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
    index, text_open, thinking_open = 0, False, False
    answer, released = (tools.prefix if tools is not None else ""), 0
    pieces = split_pieces(texts, reasoning).__aiter__()
    while True:
        try:
            thought, piece = await pieces.__anext__()
        except StopAsyncIteration:
            break
        except MeshError as exc:
            # The stream ends with Anthropic's error event (the status is sent already).
            error = error_response_body(from_mesh_error(exc, 1))
            yield sse_event("error", {"error": error["error"]})
            return
        if thought:
            if not thinking_open:
                block = {"type": "thinking", "thinking": "", "signature": ""}
                yield sse_event("content_block_start", {"index": index, "content_block": block})
                thinking_open = True
            delta = {"type": "thinking_delta", "thinking": thought}
            yield sse_event("content_block_delta", {"index": index, "delta": delta})
        if thinking_open and piece:
            yield sse_event("content_block_stop", {"index": index})
            thinking_open, index = False, index + 1
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
    if thinking_open:  # the output ended inside the thought
        yield sse_event("content_block_stop", {"index": index})
        index += 1
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
