"""Checks every request passes before a route runs: the API key, the body's size, arrival time and
validity as Unicode.

A pure ASGI middleware, so a rejected request costs no parsing: a missing or wrong key is a 401, a
body over the limit a 413 (by its Content-Length, or while it is read when it has none), a body not
complete within ``body_timeout_s`` a 408, and a JSON body holding a lone UTF-16 surrogate
(``"\\ud800"``, not valid Unicode) a 400 naming the field. The arrival time (``time.monotonic()``)
is stamped into the request's state (``arrival_time``) before anything else, so latencies count
from there. The body of an accepted request is handed on unchanged. ``/health`` and ``/metrics``
need no key; ``/v1/*`` and the API documentation (``/docs``, ``/redoc``, ``/openapi.json``) do.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.server.validation import lone_surrogate
from deepinfer.text_input import InvalidTextError, require_valid_text
from deepinfer.web.errors import ApiError, dialect_of

PROTECTED_PREFIXES = ("/v1/", "/docs", "/redoc", "/openapi.json")


class RequestGuard:
    """ASGI middleware: authentication (``Authorization: Bearer KEY`` or ``x-api-key: KEY``) for
    the protected routes when ``api_key`` is set, the ``max_body_bytes`` and ``body_timeout_s``
    limits and the Unicode check for every route."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
                self._authenticate(headers)
            receive = await self._read_body(headers, receive)
        except ApiError as error:
            await error.response(dialect_of(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authenticate(self, headers: dict[str, str]) -> None:
        bearer = headers.get("authorization", "")
        offered = [headers.get("x-api-key", "")]
        if bearer[:7].lower() == "bearer ":
            offered.append(bearer[7:].strip())
        expected = self.api_key.encode()
        if not any(o and secrets.compare_digest(o.encode(), expected) for o in offered):
            raise ApiError(
                401,
                "missing or invalid API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}; the limit is {self.max_body_bytes} bytes")

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> Receive:
        """Read the whole body within the limits; returns a ``receive`` that replays it."""
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(f"{declared} bytes")
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request":
                return _replay([message], receive)  # disconnected before the body was complete
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(f"over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                found = lone_surrogate(body)
                if found is not None:
                    path, text = found
                    try:
                        require_valid_text(text, path)
                    except InvalidTextError as exc:
                        raise ApiError(400, str(exc), param=path) from None
                return _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
