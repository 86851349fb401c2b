"""The server's life as a process: start the engine cores, serve HTTP, drain, and exit with a code
that tells an orchestrator what happened.

:func:`run` is the whole sequence on sockets the caller already bound (so a busy port fails in a
second, before any model loads): start the client's cores and wait until they are ready (a core
that fails first is a one-line error, exit 2), serve with :class:`Server`, then stop the cores.
:class:`Server` is uvicorn's server with two changes:

- SIGTERM / SIGINT start a **drain** instead of stopping at once: new requests get 503 with
  Retry-After (``/health`` too), requests in flight may finish for up to ``drain_timeout_s``; the
  rest are then ended with an error (on streams: an error event, then ``[DONE]`` where the API
  uses it), and the server stops with exit code 0. A second signal stops it at once. The signal
  may come to this process alone or to its whole process group (``timeout``, systemd, container
  runtimes, Ctrl-C): the engine cores ignore SIGTERM and SIGINT (``deepinfer.core.main``), serve
  the drain, and are stopped by :func:`run` after it.
- :meth:`Server.fatal` (the client calls it when a core died and is not restarted) stops it with
  exit code 1, after the failed requests' errors were sent.

:class:`IdleTimeoutHttpToolsProtocol` (and its h11 twin) also close connections that open and never
send a request within ``timeout_keep_alive`` (uvicorn only times out idle connections after a first
response).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deepinfer.core.client import CoreStartupError, EngineClient, EngineDead
from deepinfer.logger import get_logger
from deepinfer.server.context import ServingContext

logger = get_logger(__name__)

FLUSH_S = 0.3  # after ending requests with an error: time for the error events to reach their clients


class _IdleTimeout:
    """Arms uvicorn's keep-alive timer from the moment a connection opens (mixed into its protocols)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class IdleTimeoutH11Protocol(_IdleTimeout, H11Protocol):
    """uvicorn's h11 protocol (pure Python), with the keep-alive timer armed from the connection's start."""


class IdleTimeoutHttpToolsProtocol(_IdleTimeout, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp in C; what ``deepinfer serve`` uses: with uvloop, front CPU
    per streamed token fell from 554 to 366 us beside h11 on asyncio's loop), with the keep-alive
    timer armed from the connection's start."""


class Server(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM/SIGINT and a fatal stop (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self.should_exit or self._loop is None:
            self.should_exit = self.force_exit = True  # a second signal: stop now
            return
        self._loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Begin the drain (idempotent)."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained())

    async def _drained(self) -> None:
        ctx, client = self.ctx, self.ctx.client
        ctx.draining = True
        logger.warning(
            "shutting down: %d requests in flight may finish within %g s; new requests get 503",
            client.num_in_flight,
            self.drain_timeout_s,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while client.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = client.fail_all(
            EngineDead(
                f"the server shut down before the request finished (drain timeout {self.drain_timeout_s:g} s)"
            )
        )
        if cut:
            logger.warning("drain timeout: %d requests ended with an error", cut)
            await asyncio.sleep(FLUSH_S)
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        """A core died for good: stop serving, exit code 1."""
        logger.error("%s; the server exits", reason)
        self.exit_code = 1
        self.ctx.draining = True
        asyncio.get_running_loop().call_later(FLUSH_S, setattr, self, "should_exit", True)


async def run(
    server: Server,
    client: EngineClient,
    sockets: list[socket.socket],
    banner: Callable[[], str] | None = None,
) -> int:
    """Start the cores, serve until drained or fatal, stop the cores; returns the exit code."""
    try:
        await client.start()
    except CoreStartupError as exc:
        print(f"deepinfer serve: error: the engine could not start: {exc}", file=sys.stderr)
        return 2
    if banner is not None:
        print(banner(), file=sys.stderr, flush=True)
    try:
        await server.serve(sockets)
    finally:
        await client.stop()
    return server.exit_code
