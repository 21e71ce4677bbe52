"""OpenAI-shaped HTTP errors: ``{"error": {"message", "type", "param", "code"}}``.

Every error the frontend returns goes through ``OpenAIError``; mesh errors are
mapped with their own ``http_status`` and ``openai_type`` (mesh/errors.py), and
retryable ones (429, 503) carry ``Retry-After``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mesh.errors import CapacityExceeded, MeshError, Unavailable

logger = logging.getLogger(__name__)

_CODES_BY_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}
_TYPES_BY_STATUS = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error"}


class OpenAIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES_BY_STATUS.get(status, "error")
        default_type = "service_unavailable" if status == 503 else "invalid_request_error"
        self.error_type = error_type or _TYPES_BY_STATUS.get(status, default_type)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_mesh_error(exc: MeshError, retry_after_s: int) -> OpenAIError:
    """The HTTP answer for a typed mesh error (429 and 503 carry Retry-After)."""
    headers = {}
    if isinstance(exc, CapacityExceeded | Unavailable):
        headers["Retry-After"] = str(retry_after_s)
    return OpenAIError(
        exc.http_status, exc.message, error_type=exc.openai_type, headers=headers or None
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})


# A union member that is a model is tagged by its class name (``SpeculationControl``):
# not a field of the request (those are lower case).
_MODEL_TAG = re.compile(r"[A-Z][A-Za-z0-9]*")


def _clean_loc(loc: tuple) -> tuple[str, ...]:
    """The data path of a pydantic error, without its source ('body', 'query', ...)
    and without union member tags."""
    if loc and loc[0] in _SOURCES:
        loc = loc[1:]
    parts = []
    for part in loc:
        text = str(part)
        if text in _TYPE_TAGS or "[" in text or "-" in text or _MODEL_TAG.fullmatch(text):
            continue
        parts.append(text)
    return tuple(parts)


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """A 400 naming the offending field (missing field, wrong type, bad value).

    For a union (``stop``: a string or a list of strings) pydantic reports one error
    per member; the deepest path is the member the caller meant, and equally deep
    alternatives are listed together.
    """
    errors = [(_clean_loc(tuple(e.get("loc", ()))), e) for e in exc.errors()]
    if not errors:
        return bad_request("the request body is invalid")
    depth = max(len(loc) for loc, _ in errors)
    deepest = [(loc, e) for loc, e in errors if len(loc) == depth]
    # An unknown field says more than the field it may have been meant for.
    deepest.sort(key=lambda item: item[1].get("type") != "extra_forbidden")
    loc, first = deepest[0]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first.get("type") == "missing":
        return bad_request(f"missing required field '{where}'", param, code="missing_field")
    messages: list[str] = []
    for other_loc, error in deepest:
        text = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if other_loc == loc and text not in messages:
            messages.append(text)
    return bad_request(f"invalid value for '{where}': {', or '.join(messages)}", param)


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Answer every error the app raises, and unknown routes, in OpenAI's shape."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_mesh_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MeshError)
        if exc.http_status >= 500 and not isinstance(exc, Unavailable):
            logger.error("request %s %s failed: %s", request.method, request.url.path, exc)
        return from_mesh_error(exc, retry_after_s).response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_error(exc).response()

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return OpenAIError(exc.status_code, message, headers=exc.headers).response()

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(MeshError, on_mesh_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
