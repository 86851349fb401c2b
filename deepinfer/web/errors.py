"""Errors, in the shape of the API that was called.

Routes raise :class:`ApiError`; the handlers installed by :func:`install_error_handlers` turn it, and
request-validation failures, unknown routes and unexpected exceptions, into a JSON error in the
caller's dialect: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (chosen by path: ``/v1/messages`` is Anthropic's).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deepinfer.logger import get_logger

logger = get_logger(__name__)


class Dialect(enum.Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def dialect_of(path: str) -> Dialect:
    return Dialect.ANTHROPIC if path.startswith("/v1/messages") else Dialect.OPENAI


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A request that cannot be served: HTTP ``status``, a message for the caller, the request
    field at fault (``param``, e.g. ``"messages[2].content"``) and extra response headers."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self, dialect: Dialect) -> dict[str, Any]:
        if dialect is Dialect.ANTHROPIC:
            kind = _ANTHROPIC_TYPES.get(
                self.status, "api_error" if self.status >= 500 else "invalid_request_error"
            )
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        kind = _OPENAI_TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        code = "model_not_found" if self.status == 404 and self.param == "model" else None
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def response(self, dialect: Dialect) -> JSONResponse:
        return JSONResponse(self.body(dialect), status_code=self.status, headers=self.headers)


def field_path(loc: Sequence[str | int]) -> str:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 naming the first invalid field. A value that matches none of a union's alternatives
    yields one error per alternative: they are reported as one problem of their common field."""
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}")
    same_field = [loc for loc in locs if loc[:1] == locs[0][:1]]
    common = locs[0] if len(same_field) == 1 else _common_prefix(same_field)
    param = field_path(common) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(same_field) > 1:
        message += f" (no accepted form matched; {len(same_field)} tried)"
    others = len(errors) - len(same_field)
    if others:
        message += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return ApiError(400, message, param=param)


def _common_prefix(locs: Sequence[Sequence[str | int]]) -> list[str | int]:
    prefix: list[str | int] = []
    for parts in zip(*locs):
        if any(p != parts[0] for p in parts):
            break
        prefix.append(parts[0])
    return prefix


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(dialect_of(request.url.path))

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response(dialect_of(request.url.path))

    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail), headers=exc.headers)
        return error.response(dialect_of(request.url.path))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal error: {type(exc).__name__}")
        return error.response(dialect_of(request.url.path))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
