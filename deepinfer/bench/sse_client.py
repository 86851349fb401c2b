"""A lean HTTP/1.1 client for benchmarking servers that stream server-sent events, on loopback.

The load generator runs on the same cores as the server it measures, so its own cost per token is
part of the measurement: a general client (httpx: a coroutine and a decoded line per event) spent
about as much CPU per streamed token as the server's front. :class:`SSEConnection` is an asyncio
protocol on one keep-alive connection that parses only the framing (status line, headers,
``Content-Length``, chunked transfer coding, SSE event boundaries) and hands each event's raw
``data:`` payload to a callback the moment its bytes arrive (which is where a benchmark takes its
timestamps). It never decodes JSON itself.

Scope: one request at a time per connection (no pipelining), ``POST`` with a JSON body, responses
framed by chunked coding, ``Content-Length`` or connection close. A response that is not ``200``
is read whole and returned as its body instead of being parsed as events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

EventHandler = Callable[[bytes], None]

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _FIXED, _UNTIL_EOF, _DONE = range(8)


@dataclass(slots=True)
class Response:
    """A finished response: its status and, unless it was a ``200`` event stream, its body."""

    status: int
    body: bytes


class SSEConnection(asyncio.Protocol):
    """One keep-alive connection to ``host:port``; :meth:`post` sends a request and streams its events.
    Reconnects by itself when the server closed the previous connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._transport: asyncio.Transport | None = None
        self._pending: asyncio.Future[Response] | None = None
        self._on_event: EventHandler | None = None
        self._buf = bytearray()
        self._events = bytearray()  # event-stream bytes not yet cut into events
        self._body = bytearray()  # a non-200 body
        self._state = _DONE
        self._status = 0
        self._remaining = 0
        self._keep_alive = True

    async def post(self, path: str, body: bytes, on_event: EventHandler, headers: dict[str, str]) -> Response:
        """``POST path`` with the JSON ``body``; ``on_event(data)`` runs for every SSE ``data:``
        payload of a ``200`` response, as its bytes arrive. Raises ``ConnectionError`` if the server
        closes the connection before the response is complete."""
        if self._pending is not None:
            raise RuntimeError("SSEConnection.post: a request is already in flight on this connection")
        if self._transport is None or self._transport.is_closing():
            loop = asyncio.get_running_loop()
            await loop.create_connection(lambda: self, self.host, self.port)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        )
        self._pending = asyncio.get_running_loop().create_future()
        self._on_event = on_event
        self._state, self._status, self._keep_alive = _HEAD, 0, True
        self._events.clear()
        self._body.clear()
        self._transport.write(head.encode("latin-1") + body)
        try:
            return await self._pending
        finally:
            self._pending = self._on_event = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._buf.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._state == _UNTIL_EOF:
            self._finish()
        elif self._pending is not None and not self._pending.done():
            self._pending.set_exception(
                ConnectionError(f"the server closed the connection mid-response: {exc}")
            )
        self._state = _DONE

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except ValueError as exc:  # malformed framing: this connection cannot be trusted any more
            if self._pending is not None and not self._pending.done():
                self._pending.set_exception(ConnectionError(f"malformed HTTP response: {exc}"))
            self._state = _DONE
            self.close()

    # ------------------------------------------------------------------ framing
    def _parse(self) -> None:
        buf = self._buf
        while buf and self._state != _DONE:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head(bytes(buf[:end]).decode("latin-1"))
                del buf[: end + 4]
            elif state in (_CHUNK_SIZE, _CHUNK_END, _TRAILER):
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(buf[:end])
                del buf[: end + 2]
                if state == _CHUNK_SIZE:
                    self._remaining = int(line.split(b";", 1)[0], 16)
                    self._state = _CHUNK_DATA if self._remaining else _TRAILER
                elif state == _CHUNK_END:
                    if line:
                        raise ValueError("a chunk is longer than its size line says")
                    self._state = _CHUNK_SIZE
                elif not line:  # the blank line that ends the trailer
                    self._finish()
            elif state in (_CHUNK_DATA, _FIXED):
                take = min(self._remaining, len(buf))
                self._content(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if not self._remaining:
                    if state == _CHUNK_DATA:
                        self._state = _CHUNK_END
                    else:
                        self._finish()
            else:  # _UNTIL_EOF
                self._content(bytes(buf))
                buf.clear()

    def _head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad status line {status_line!r}")
        self._status = int(parts[1])
        fields = {}
        for line in lines:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip().lower()
        self._keep_alive = fields.get("connection") != "close"
        if "chunked" in fields.get("transfer-encoding", ""):
            self._state = _CHUNK_SIZE
        elif "content-length" in fields:
            self._remaining = int(fields["content-length"])
            self._state = _FIXED if self._remaining else _DONE
            if not self._remaining:
                self._finish()
        else:
            self._keep_alive = False
            self._state = _UNTIL_EOF

    def _content(self, data: bytes) -> None:
        if self._status != 200:
            self._body += data
            return
        events = self._events
        events += data
        start = 0
        while (end := events.find(b"\n\n", start)) >= 0:
            for line in bytes(events[start:end]).split(b"\n"):
                if line.startswith(b"data:"):
                    self._on_event(line[6:] if line.startswith(b"data: ") else line[5:])
            start = end + 2
        del events[:start]

    def _finish(self) -> None:
        self._state = _DONE
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(Response(self._status, bytes(self._body)))
        if not self._keep_alive:
            self.close()
