"""Server-sent events: the wire format, pre-rendered event templates, and a lean streaming response
that always closes its event source.

:class:`EventStreamResponse` sends each item of an async generator of encoded events with one direct
ASGI ``send`` (no per-event framework machinery), while a second task waits for the client's
``http.disconnect``. However the response ends (the events ran out, the client left, the task was
cancelled), it closes the generator and runs an ``on_close`` callback (aborting the engine request,
freeing its KV blocks) at once; a generator left suspended at a ``yield`` would otherwise be
finalized only whenever the garbage collector runs.

:class:`EventTemplate` renders the one event a stream sends per token (a text delta) from JSON made
once per stream: only the text is escaped per event, byte for byte what ``sse`` gives for the same
data.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One event: an optional ``event:`` line, one ``data:`` line (JSON unless a string), a blank line."""
    payload = data if isinstance(data, str) else _JSON.encode(data)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


class EventTemplate:
    """An event whose data differs only in one string: ``render(text)`` equals
    ``sse(data_with(text), event)``, with the JSON around the text made once.

    ``data_with``: builds the event's data with the given string at the varying place (it must be
    the only place the string appears)."""

    def __init__(self, data_with: Callable[[str], dict[str, Any]], event: str | None = None) -> None:
        marker = f"text-{uuid.uuid4().hex}"
        head, hole, tail = sse(data_with(marker), event).partition(f'"{marker}"')
        if not hole or marker in tail:
            raise ValueError("the template's data must hold the varying string exactly once")
        self._head, self._tail = head + '"', '"' + tail

    def render(self, text: str) -> str:
        return f"{self._head}{_JSON.encode(text)[1:-1]}{self._tail}"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of encoded events (``str`` or
    ``bytes``; each item is sent as one body message, so a caller that has several events ready
    yields them joined); ``on_close`` runs once the response has ended, however it ended."""

    def __init__(self, events: AsyncGenerator[str | bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            try:
                await self._events.aclose()
            finally:
                self._on_close()
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._events:
            body = chunk.encode() if isinstance(chunk, str) else chunk
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
