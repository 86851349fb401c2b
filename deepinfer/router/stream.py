"""Server-sent events as the router relays them: whole events only, which events mean the worker has
started producing output, and the error event that ends a stream in each API's shape.

The router forwards a worker's stream event by event (never half an event, so an error event it
adds after a worker died is well-formed). Until a worker's first *output* event (generated text, a
finish, usage, or the worker's own error), nothing has been decided for the client: the router holds
the stream's opening events back and may still retry elsewhere. The stream's last event (or an
error event) says how the request ended, for the router's request metrics.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from deepinfer.web.errors import ApiError, Dialect
from deepinfer.web.sse import sse

Api = Literal["chat", "completions", "responses", "messages"]
API_PATHS: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
_MESSAGES_OUTPUT = {"content_block_delta", "message_delta", "message_stop", "error"}
_RESPONSES_END = {"response.completed", "response.incomplete", "response.failed", "error"}
_RESPONSES_FAILED = {"response.failed", "error"}


class EventSplitter:
    """Cuts a byte stream into whole SSE events (each ending with a blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")  # a CR LF may span two chunks
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [e + b"\n\n" for e in events if e.strip()]


def _data(event: bytes) -> Any:
    lines = [
        line[5:].strip() for line in event.decode("utf-8", "replace").split("\n") if line.startswith("data:")
    ]
    if not lines:
        return None
    text = "\n".join(lines)
    if text == "[DONE]":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def carries_output(api: Api, event: bytes) -> bool:
    """Whether ``event`` shows the worker produced something (see the module docstring)."""
    data = _data(event)
    if data == "[DONE]":
        return True
    if not isinstance(data, dict):
        return False
    if "error" in data or data.get("usage"):
        return True
    if api == "messages":
        return data.get("type") in _MESSAGES_OUTPUT
    if api == "responses":
        kind = str(data.get("type", ""))
        return kind.endswith(".delta") or kind in _RESPONSES_END
    for choice in data.get("choices") or ():
        if choice.get("finish_reason") is not None:
            return True
        if api == "completions" and choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if api == "chat" and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


def stream_outcome(api: Api, event: bytes) -> str | None:
    """``"ok"`` when ``event`` is its API's last event of a stream that ended normally (``[DONE]``,
    ``message_stop``, ``response.completed`` / ``response.incomplete``), ``"error"`` when it reports
    an error (the worker's own error event, ``response.failed``), else ``None``."""
    data = _data(event)
    if data == "[DONE]":
        return "ok"
    if not isinstance(data, dict):
        return None
    kind = data.get("type")
    if api == "responses" and kind in _RESPONSES_END:
        return "error" if kind in _RESPONSES_FAILED else "ok"
    if "error" in data or kind == "error":
        return "error"
    if api == "messages" and kind == "message_stop":
        return "ok"
    return None


def dialect(api: Api) -> Dialect:
    return Dialect.ANTHROPIC if api == "messages" else Dialect.OPENAI


def error_events(api: Api, error: ApiError, events_sent: int) -> bytes:
    """The events that end a stream with ``error``, in ``api``'s shape (``events_sent``: events the
    client has received, the Responses API's next sequence number)."""
    if api == "messages":
        return sse(error.body(Dialect.ANTHROPIC), event="error").encode()
    if api == "responses":
        body = error.body(Dialect.OPENAI)["error"]
        data = {"type": "error", "sequence_number": events_sent, "code": body["code"], "message": body["message"],
                "param": body["param"]}  # fmt: skip
        return sse(data, event="error").encode()
    return (sse(error.body(Dialect.OPENAI)) + sse("[DONE]")).encode()
