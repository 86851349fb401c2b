"""The load generator's lean SSE client against a scripted loopback server: chunked event streams
cut at awkward byte boundaries, keep-alive reuse, non-200 bodies, and a connection that dies."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.bench.sse_client import SSEConnection


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def serve_script(responses: list[bytes], step: int) -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """A server answering each request on a connection with the next scripted response, written
    ``step`` bytes at a time; returns the server, its port and the requests it read."""
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            requests.append(head + await reader.readexactly(length))
            data = responses.pop(0)
            for i in range(0, len(data), step):
                writer.write(data[i : i + step])
                await writer.drain()
                await asyncio.sleep(0)
            if b"connection: close" in data.lower():
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], requests


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_events_arrive_whole_across_any_cut_and_the_connection_is_reused(step: int) -> None:
    first = STREAM_HEAD + chunked(b'data: {"a":1}\n\n', b'data: {"b"', b":2}\n\ndata: [DONE]\n\n")
    second = STREAM_HEAD + chunked(b"event: x\ndata: two\n\n")

    async def main() -> tuple[list[bytes], list[bytes], list[int], list[bytes]]:
        server, port, requests = await serve_script([first, second], step)
        conn = SSEConnection("127.0.0.1", port)
        seen: list[bytes] = []
        again: list[bytes] = []
        statuses = [(await conn.post("/v1/x", b'{"q":1}', seen.append, {"X-Key": "k"})).status]
        statuses.append((await conn.post("/v1/y", b"{}", again.append, {})).status)
        conn.close()
        server.close()
        await server.wait_closed()
        return seen, again, statuses, requests

    seen, again, statuses, requests = asyncio.run(main())
    assert seen == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
    assert again == [b"two"]
    assert statuses == [200, 200]
    assert len(requests) == 2  # both on the one connection
    assert requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and b"X-Key: k\r\n" in requests[0]
    assert requests[0].endswith(b'\r\n\r\n{"q":1}')


def test_an_error_status_returns_its_body_and_no_events() -> None:
    body = b'{"error":{"message":"no"}}'
    response = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async def main():
        server, port, _ = await serve_script([response], 5)
        events: list[bytes] = []
        result = await SSEConnection("127.0.0.1", port).post("/", b"{}", events.append, {})
        server.close()
        return result, events

    result, events = asyncio.run(main())
    assert (result.status, result.body, events) == (404, body, [])


def test_a_connection_closed_mid_stream_raises() -> None:
    cut = STREAM_HEAD + b"10\r\ndata: {}\n\n"  # a chunk promised, the connection then closes

    async def main():
        server, port, _ = await serve_script([cut], 4096)
        conn = SSEConnection("127.0.0.1", port)
        try:
            await asyncio.wait_for(conn.post("/", b"{}", lambda _: None, {}), 10)
        finally:
            server.close()

    with pytest.raises(ConnectionError, match="closed the connection"):
        asyncio.run(main())
