"""The Responses API's routes beside ``POST /v1/responses`` (app.py): ``GET`` and
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``, over the
responses stage 0 keeps (response_store.py); and the parse step of ``POST`` that
resolves ``previous_response_id`` and ``item_reference`` items and keeps the
answer."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stage.frontend import responses
from stage.frontend.errors import bad_request
from stage.frontend.response_store import ResponseStore, expand
from stage.frontend.responses_answer import ResponseShape
from stage.frontend.schemas import ChatCompletionBody

RESPONSES_PATH = "/v1/responses"
MAX_LIST = 100


def parse_response_request(
    payload: dict[str, Any], store: ResponseStore, tenant: str, model_id: str
) -> tuple[ChatCompletionBody, ResponseShape]:
    """A Responses request as its chat twin and the shape of its answer, with the
    stored items it names in its input; the answer is kept unless ``store: false``."""
    payload, items, previous = expand(payload, store, tenant)
    body, chat = responses.parse_body(payload, model_id)
    keep = store.enabled and body.store is not False

    def kept(response: dict[str, Any]) -> None:
        store.put(tenant, response, items)

    return chat, ResponseShape(
        body,
        body.model or model_id,
        stored=keep,
        previous_response_id=previous,
        on_final=kept if keep else None,
    )


def _listed(request: Request, items: list[dict[str, Any]]) -> dict[str, Any]:
    """``input_items``: OpenAI's list shape, newest first unless ``order=asc``, a page
    of ``limit`` items from the one after ``after`` (an item id) on."""
    order = request.query_params.get("order", "desc")
    limit_text = request.query_params.get("limit", "20")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
        raise bad_request(f"limit must be 1 to {MAX_LIST}", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = request.query_params.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(
                f"after: no input item {after!r} in this response; pass the last_id of "
                "the page before",
                "after",
            )
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit_text)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > len(page),
    }


def add_response_routes(app: FastAPI, front: Any) -> None:
    """Add the stored responses' routes to ``app`` (``front``: app.py's
    ``_Frontend``, whose ``responses`` is the store)."""

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def get_response(request: Request, response_id: str) -> JSONResponse:
        tenant = front.authorize(request)
        stored = front.responses.get(tenant, response_id)
        if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
            # Streaming a retrieve replays a background response; every response here
            # was answered in the foreground and is stored whole.
            raise bad_request(
                f"response {response_id} was not created with background=true, so it cannot "
                "be streamed: retrieve it without stream",
                "stream",
            )
        return JSONResponse(stored.response)

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete_response(request: Request, response_id: str) -> JSONResponse:
        tenant = front.authorize(request)
        front.responses.delete(tenant, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> JSONResponse:
        tenant = front.authorize(request)
        stored = front.responses.get(tenant, response_id)
        return JSONResponse(_listed(request, list(stored.input_items)))
