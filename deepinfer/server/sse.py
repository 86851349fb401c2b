"""Server-sent events: the wire format, and a response that always closes its event source.

When a client disconnects, Starlette cancels the streaming response; the event generator may then
be suspended at a ``yield`` (finalized only whenever the garbage collector runs), or not even
started (its ``finally`` never runs). :class:`EventStreamResponse` therefore closes the generator
and runs an ``on_close`` callback (aborting the engine request, freeing its KV blocks) the moment
the response ends, however it ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One event: an optional ``event:`` line, one ``data:`` line (JSON unless a string), a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of encoded events; ``on_close``
    runs once the response has ended, however it ended."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()
