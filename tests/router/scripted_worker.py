"""A scripted worker for router tests: a real HTTP server on loopback (uvicorn in a thread) that
speaks the router protocol (``GET /load``, ``GET /health``) and answers chat completions and
Anthropic messages from a script, plain or streamed; a stream can be made to break after its first
output events (the connection dropped mid-body, as when a worker dies). It records every request it
received (path, headers, body), so tests can check what the router forwarded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deepinfer.core.load import model_fingerprint
from deepinfer.core.roles import Role
from deepinfer.model_zoo import default_model_path
from deepinfer.server.launch import bind
from deepinfer.web.sse import sse
from tests.router.test_policies import report


class WorkerDied(Exception):
    """Raised inside a scripted stream: uvicorn drops the connection mid-body."""


@dataclass
class ScriptedWorker:
    """The worker's script and what it saw. ``break_after``: a stream sends this many text deltas,
    then the connection drops (``None``: it completes); ``delay_s``: the pause before each delta."""

    url: str = ""
    words: tuple[str, ...] = ("one", " two", " three", " four")
    break_after: int | None = None
    delay_s: float = 0.0
    received: list[dict] = field(default_factory=list)

    def app(self) -> Starlette:
        load = msgspec.structs.replace(
            report(), role=Role.BOTH, model_fingerprint=model_fingerprint(default_model_path())
        )

        async def load_route(request: Request) -> Response:
            return Response(msgspec.json.encode(load), media_type="application/json")

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            messages = request.url.path == "/v1/messages"
            if not body.get("stream"):
                text = "".join(self.words)
                if messages:
                    return JSONResponse(
                        {"type": "message", "role": "assistant", "content": [{"type": "text", "text": text}]}
                    )
                return JSONResponse({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})  # fmt: skip
            events = self._messages_stream() if messages else self._chat_stream()
            return StreamingResponse(events, media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/load", load_route),
                Route("/health", health),
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/messages", generate, methods=["POST"]),
            ]
        )

    async def _deltas(self, render) -> AsyncIterator[str]:
        for i, word in enumerate(self.words):
            await asyncio.sleep(self.delay_s)
            if self.break_after is not None and i == self.break_after:
                raise WorkerDied("scripted: the worker died mid-stream")
            yield render(word)

    async def _chat_stream(self) -> AsyncIterator[str]:
        def chunk(delta: dict, finish: str | None = None) -> str:
            return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})  # fmt: skip

        yield chunk({"role": "assistant", "content": ""})
        async for event in self._deltas(lambda w: chunk({"content": w})):
            yield event
        yield chunk({}, "stop")
        yield sse("[DONE]")

    async def _messages_stream(self) -> AsyncIterator[str]:
        yield sse({"type": "message_start", "message": {"role": "assistant", "content": []}}, "message_start")
        yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start")  # fmt: skip
        delta = lambda w: sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}, "content_block_delta")  # noqa: E731  # fmt: skip
        async for event in self._deltas(delta):
            yield event
        yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        yield sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")


@contextlib.contextmanager
def scripted_worker(start_timeout_s: float = 30.0) -> Iterator[ScriptedWorker]:
    """A :class:`ScriptedWorker` served on a free loopback port until the block ends."""
    worker = ScriptedWorker()
    sock = bind("127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(worker.app(), log_level="critical", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="scripted-worker", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the scripted worker did not start")
            time.sleep(0.01)
        yield worker
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
