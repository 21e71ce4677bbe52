"""Stored responses of the Responses API, kept in stage 0's memory.

OpenAI's Responses API stores a response unless the request says ``store: false``,
and clients chain turns with ``previous_response_id`` instead of sending the
conversation again. Stage 0 keeps the latest ``limit`` responses of each kind it
answered (least recently used out first, and at most ``MAX_STORED_CHARS`` of text in
all), each with the input items it was generated from, under the tenant of the API
key that created it: another key can neither read nor continue it (404, as for an
id that was never stored). The store lives and dies with the stage 0 process and
its model: a restart or a new package empties it.

``expand`` turns a request that names a previous response into the request it
stands for: the previous response's input items and output items, then its own
input (``instructions`` are not carried over, as OpenAI documents), and replaces
``item_reference`` items with the stored items they name.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from stage.frontend.errors import OpenAIError, bad_request

# Text kept in all (the characters of the stored items' JSON), beside the count limit.
MAX_STORED_CHARS = 64 * 2**20


@dataclass(frozen=True)
class Stored:
    tenant: str
    response: dict[str, Any]
    # The items the response was generated from (the previous responses' included).
    input_items: tuple[dict[str, Any], ...]
    size: int


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"response {response_id!r} not found: it was never stored (store: false), was "
        "deleted, was created with another API key, or is older than what this server "
        "keeps (stage 0 keeps the latest responses in memory)",
        param="response_id",
        code="not_found",
    )


class ResponseStore:
    """The latest ``limit`` responses, by id (thread-safe)."""

    def __init__(self, limit: int, max_chars: int = MAX_STORED_CHARS) -> None:
        self.limit = limit
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._responses: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def put(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if not self.enabled or size > self.max_chars:
            return
        stored = Stored(tenant, response, tuple(identified(input_items)), size)
        with self._lock:
            old = self._responses.pop(response["id"], None)
            self._chars -= old.size if old is not None else 0
            self._responses[response["id"]] = stored
            self._chars += size
            while len(self._responses) > self.limit or self._chars > self.max_chars:
                _, dropped = self._responses.popitem(last=False)
                self._chars -= dropped.size

    def get(self, tenant: str, response_id: str) -> Stored:
        """The tenant's stored response; 404 otherwise."""
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is None or stored.tenant != tenant:
                raise not_found(response_id)
            self._responses.move_to_end(response_id)
            return stored

    def delete(self, tenant: str, response_id: str) -> None:
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is None or stored.tenant != tenant:
                raise not_found(response_id)
            del self._responses[response_id]
            self._chars -= stored.size

    def item(self, tenant: str, item_id: str) -> dict[str, Any] | None:
        """A stored output or input item of the tenant's, by its ``id``."""
        with self._lock:
            for stored in reversed(self._responses.values()):
                if stored.tenant != tenant:
                    continue
                for item in (*stored.response.get("output", ()), *stored.input_items):
                    if isinstance(item, dict) and item.get("id") == item_id:
                        return item
        return None


# The id prefix of an input item of each type (others: "item_").
_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


def identified(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` as the store lists them: each with its ``type`` (a message given by
    its role alone is a ``message``, its text content as one ``input_text`` part, or
    ``output_text`` for the assistant's, and a ``status``) and an ``id`` (its own,
    else a new one), so that ``input_items`` pages by id as OpenAI's does."""
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        if "type" not in item and "role" in item:
            item["type"] = "message"
        if item.get("type") == "message":
            # As OpenAI lists them: content as parts, and a status.
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or not item["id"]:
            prefix = _ID_PREFIXES.get(str(item.get("type")), "item_")
            item["id"] = prefix + uuid.uuid4().hex[:24]
        out.append(item)
    return out


def input_items(given: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


def expand(
    payload: dict[str, Any], store: ResponseStore, tenant: str
) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
    """The request ``payload`` stands for, with what it names resolved: (payload with
    the whole input, that input as items, the previous response's id)."""
    previous = payload.get("previous_response_id")
    own = input_items(payload.get("input"))
    if previous is None and not any(_is_reference(item) for item in own):
        # An explicit null (what the SDKs send for None) is no previous response.
        return {k: v for k, v in payload.items() if k != "previous_response_id"}, own, None
    if not store.enabled:
        raise bad_request(
            "this server keeps no responses (its responses store is off); send the whole "
            "conversation as 'input'",
            "previous_response_id" if previous is not None else "input",
        )
    items: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise bad_request("previous_response_id must be a string", "previous_response_id")
        stored = store.get(tenant, previous)
        items += [*stored.input_items, *stored.response.get("output", [])]
    for item in own:
        if not _is_reference(item):
            items.append(item)
            continue
        found = store.item(tenant, item.get("id")) if isinstance(item.get("id"), str) else None
        if found is None:
            raise bad_request(f"item_reference {item.get('id')!r}: no stored item has it", "input")
        items.append(found)
    expanded = {k: v for k, v in payload.items() if k != "previous_response_id"}
    expanded["input"] = items
    return expanded, items, previous


def _is_reference(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "item_reference"
