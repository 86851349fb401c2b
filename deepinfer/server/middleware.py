"""Checks every request passes before a route runs: its credentials, the body's size, arrival time
and validity as Unicode. The worker (``deepinfer serve``) and the router (``deepinfer router``) both
run it, so they give the same limits and error shapes.

A pure ASGI middleware, so a rejected request costs no parsing: a missing or wrong key is a 401, a
body over the limit a 413 (by its Content-Length, or while it is read when it has none), a body not
complete within ``body_timeout_s`` a 408, and a JSON body holding a lone UTF-16 surrogate
(``"\\ud800"``, not valid Unicode) a 400 naming the field. The arrival time (``time.monotonic()``)
is stamped into the request's state (``arrival_time``) before anything else, so latencies count
from there. The body of an accepted request is handed on unchanged.

Credentials (``deepinfer.web.auth``): ``/health`` and ``/metrics`` need none; the ``protected``
routes (``/v1/*`` and the API documentation ``/docs``, ``/redoc``, ``/openapi.json``; the router adds
``/router/workers``) need the API key when one is set. The cluster key (the ``cluster_secret`` in
``x-deepinfer-cluster-key``) opens every route in place of the API key. A worker's router-only
routes (``GET /load``, ``POST /kv/release``) need the cluster key when a cluster secret is set (the
API key does not open them then: 403), else the API key when one is set, else nothing (an unkeyed
worker on loopback behind a plain ``deepinfer router``).
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.core.load import LOAD_PATH
from deepinfer.server.validation import lone_surrogate
from deepinfer.text_input import InvalidTextError, require_valid_text
from deepinfer.web.auth import CLUSTER_KEY_HEADER, has_cluster_key, key_matches, offered_keys
from deepinfer.web.errors import ApiError, dialect_of

PROTECTED_PREFIXES = ("/v1/", "/docs", "/redoc", "/openapi.json")
# a worker's routes for its router: the load report (router_api) and lease releases (kv_transfer.RELEASE_PATH)
ROUTER_ONLY_PATHS = (LOAD_PATH, "/kv/release")


class RequestGuard:
    """ASGI middleware: the credentials (see the module docstring; ``api_key``: what clients send as
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, ``None``: none needed; ``cluster_secret``:
    the key routers send, ``None``: none accepted), the ``max_body_bytes`` and ``body_timeout_s``
    limits and the Unicode check for every route. ``protected``: path prefixes that need the API
    key; ``router_only``: exact paths only a router may call (the worker's by default)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        *,
        cluster_secret: str | None = None,
        protected: tuple[str, ...] = PROTECTED_PREFIXES,
        router_only: tuple[str, ...] = ROUTER_ONLY_PATHS,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.cluster_secret = cluster_secret
        self.protected = protected
        self.router_only = router_only
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._authorise(scope["path"], headers)
            receive = await self._read_body(headers, receive)
        except ApiError as error:
            await error.response(dialect_of(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorise(self, path: str, headers: dict[str, str]) -> None:
        """``ApiError`` 401/403 unless the request's credentials open ``path``."""
        if has_cluster_key(headers, self.cluster_secret):
            return
        if path in self.router_only:
            if self.cluster_secret is not None:
                raise ApiError(
                    403 if offered_keys(headers) or CLUSTER_KEY_HEADER in headers else 401,
                    f"{path} is for this worker's router only: send the cluster secret in the "
                    f"{CLUSTER_KEY_HEADER} header (an API key does not open it)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if self.api_key is not None:
                self._authenticate(headers)
            return
        if self.api_key is not None and path.startswith(self.protected):
            self._authenticate(headers)

    def _authenticate(self, headers: dict[str, str]) -> None:
        if not any(key_matches(key, self.api_key) for key in offered_keys(headers)):
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
