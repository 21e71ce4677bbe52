"""The Responses API's answer: the ``response`` object, its output items, its events.

``output`` holds a ``message`` item with one ``output_text`` part (when the answer
has text, or calls nothing) and then a ``function_call`` item per call the model
made, parsed as chat parses calls (stage/frontend/tool_formats.py). ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the token budget ran out before the answer ended.

Streamed, each event is ``event: <type>`` and ``data:`` a JSON object with ``type``
and ``sequence_number`` (from 0): ``response.created`` and ``response.in_progress``
(the response so far, status ``in_progress``); for the message
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for each call
``response.output_item.added``, ``response.function_call_arguments.delta`` (the
whole arguments at once), ``response.function_call_arguments.done``,
``response.output_item.done``; and last ``response.completed`` (or
``response.incomplete``) with the whole response. As on chat, text from (what may
become) a tool call on is held back until the answer is complete. A failure
mid-stream ends the stream with an ``error`` event.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from mesh.errors import MeshError
from stage.frontend.errors import from_mesh_error
from stage.frontend.generation import GenerationRun
from stage.frontend.reasoning import split_pieces, split_reasoning
from stage.frontend.responses import FunctionChoice, ResponsesAllowedTools, ResponsesBody
from stage.frontend.tools import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``message`` output item; ``text`` None while no part was added yet."""
    content = [] if text is None else [_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item: a reasoning model's thought, as its text (``text``
    None while none was added yet)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(run: GenerationRun) -> dict[str, Any]:
    prompt = len(run.request.prompt_tokens)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": run.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": run.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens or 0},
        "total_tokens": prompt + run.completion_tokens,
    }


def status_of(run: GenerationRun, calls: list[ToolCall]) -> str:
    """``incomplete`` when the token budget ended the answer (its complete calls are
    kept), else ``completed``."""
    return "incomplete" if run.finish_reason == "length" else "completed"


@dataclass(frozen=True)
class ResponseShape:
    """A run's answer as a Responses API ``response``, or as its stream (see
    stage/frontend/translated.py)."""

    request: ResponsesBody
    model: str
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Whether the response is kept (response_store.py), and the one it continues.
    stored: bool = False
    previous_response_id: str | None = None
    # Called with the finished response (to keep it).
    on_final: Callable[[dict[str, Any]], None] | None = None

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The response object, with what the request asked for echoed as OpenAI does."""
        request = self.request
        form = request.format
        choice = request.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "name": choice.name}
        elif isinstance(choice, ResponsesAllowedTools):
            choice = choice.model_dump()
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        metadata = (request.model_extra or {}).get("metadata")
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": metadata if isinstance(metadata, dict) else {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": self.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {
                "format": (
                    {"type": "text"}
                    if form is None
                    else form.model_dump(by_alias=True, exclude_none=True)
                )
            },
            "tool_choice": choice or "auto",
            "tools": [tool.echo() for tool in request.tools or ()],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
        }

    def body(self, run: GenerationRun, text: str) -> dict[str, Any]:
        thought = None
        if run.prepared.reasoning is not None:
            thought, text = split_reasoning(text, run.prepared.reasoning)
        tools = run.prepared.tools
        prefix = tools.prefix if tools is not None else ""
        content, calls = tools.split(prefix + text) if tools is not None else (text, [])
        status = status_of(run, calls)
        output = [reasoning_item(new_id("rs"), thought, "completed")] if thought else []
        # No message where a forced call was all the budget allowed (content None).
        if content or (not calls and content is not None):
            output.append(message_item(new_id("msg"), content or "", status))
        output += [call_item(new_id("fc"), call, call.arguments, "completed") for call in calls]
        return self._finished(self.response(status, output, usage_of(run)))

    def _finished(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.on_final is not None:
            self.on_final(response)
        return response

    async def events(self, run: GenerationRun, texts: AsyncIterator[str]) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(kind: str, **payload: Any) -> bytes:
            return sse_event({"type": kind, "sequence_number": next(numbers), **payload})

        started = self.response("in_progress", [], None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        tools = run.prepared.tools
        message = _MessageStream(new_id("msg"), event)
        thinking = _ThoughtStream(new_id("rs"), event)
        output: list[dict[str, Any]] = []
        answer, released = (tools.prefix if tools is not None else ""), 0
        pieces = split_pieces(texts, run.prepared.reasoning).__aiter__()
        while True:
            try:
                thought, piece = await pieces.__anext__()
            except StopAsyncIteration:
                break
            except MeshError as exc:
                error = from_mesh_error(exc, 1)
                yield event("error", code=error.code, message=error.message, param=error.param)
                return
            for chunk in thinking.add(thought):
                yield chunk
            if thinking.opened and not thinking.closed and piece:
                for chunk in thinking.close():
                    yield chunk
                output.append(reasoning_item(thinking.item_id, thinking.text, "completed"))
                message.output_index = len(output)
            if tools is not None:
                answer += piece
                cut = max(released, tools.hold_start(answer))
                piece, released = answer[released:cut], cut
            for chunk in message.add(piece):
                yield chunk
        if thinking.opened and not thinking.closed:  # the output ended inside the thought
            for chunk in thinking.close():
                yield chunk
            output.append(reasoning_item(thinking.item_id, thinking.text, "completed"))
            message.output_index = len(output)
        # The held text (a tool was given: ``answer`` is empty otherwise).
        held = answer[released:]
        content, calls = tools.split(held) if tools is not None and held else (held, [])
        status = status_of(run, calls)
        for chunk in message.add(content or "", force=not calls and content is not None):
            yield chunk
        if message.opened:
            for chunk in message.close(status):
                yield chunk
            output.append(message_item(message.item_id, message.text, status))
        for call in calls:
            index, item_id = len(output), new_id("fc")
            added = call_item(item_id, call, "", "in_progress")
            yield event("response.output_item.added", output_index=index, item=added)
            where = {"item_id": item_id, "output_index": index}
            yield event("response.function_call_arguments.delta", **where, delta=call.arguments)
            yield event("response.function_call_arguments.done", **where, arguments=call.arguments)
            done = call_item(item_id, call, call.arguments, "completed")
            yield event("response.output_item.done", output_index=index, item=done)
            output.append(done)
        final = self._finished(self.response(status, output, usage_of(run)))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield event(kind, response=final)


class _ThoughtStream:
    """The events of a reasoning model's ``reasoning`` item (output index 0, before
    the answer): opened at the thought's first text, one delta per piece, closed
    when the answer begins."""

    def __init__(self, item_id: str, event: Callable[..., bytes]) -> None:
        self.item_id = item_id
        self.text = ""
        self.opened = self.closed = False
        self._event = event
        self._where = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def add(self, piece: str) -> list[bytes]:
        out = []
        if piece and not self.opened:
            self.opened = True
            item = reasoning_item(self.item_id, None, "in_progress")
            out.append(self._event("response.output_item.added", output_index=0, item=item))
        if piece:
            self.text += piece
            out.append(self._event("response.reasoning_text.delta", **self._where, delta=piece))
        return out

    def close(self) -> list[bytes]:
        self.closed = True
        done = reasoning_item(self.item_id, self.text, "completed")
        return [
            self._event("response.reasoning_text.done", **self._where, text=self.text),
            self._event("response.output_item.done", output_index=0, item=done),
        ]


class _MessageStream:
    """The events of the answer's ``message`` item (after the thought, if any):
    opened at its first text (or, forced, when the answer has nothing else), then
    one delta per piece."""

    def __init__(self, item_id: str, event: Callable[..., bytes]) -> None:
        self.item_id = item_id
        self.text = ""
        self.opened = False
        self.output_index = 0
        self._event = event

    @property
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.output_index, "content_index": 0}

    def add(self, piece: str, force: bool = False) -> list[bytes]:
        out = []
        if (piece or force) and not self.opened:
            self.opened = True
            item = message_item(self.item_id, None, "in_progress")
            out.append(
                self._event("response.output_item.added", output_index=self.output_index, item=item)
            )
            part = _text_part("")
            out.append(self._event("response.content_part.added", **self._where, part=part))
        if piece:
            self.text += piece
            where = self._where
            out.append(self._event("response.output_text.delta", **where, delta=piece, logprobs=[]))
        return out

    def close(self, status: str) -> list[bytes]:
        where, part = self._where, _text_part(self.text)
        return [
            self._event("response.output_text.done", **where, text=self.text, logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event(
                "response.output_item.done",
                output_index=self.output_index,
                item=message_item(self.item_id, self.text, status),
            ),
        ]
