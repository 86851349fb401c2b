"""Access and load: API keys, the bounded queue (429 while /health stays fast), clients that
disconnect mid-stream (their KV blocks come back), and an engine thread that sleeps when idle."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerHandle, start_server

KEY = "sk-test-key"
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def guarded(deepseek_model: Path) -> Iterator[ServerHandle]:
    """An API key, two engine slots and one queue slot: three requests in flight at most."""
    yield from start_server(deepseek_model, engine={"max_num_seqs": 2}, api_key=KEY, max_queued_requests=1)


def test_api_key_is_required_when_set(guarded: ServerHandle) -> None:
    with (
        openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
    with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as client:
        assert client.models.list().data[0].id == MODEL_NAME
    with anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=guarded.url, api_key=KEY, max_retries=0) as client:
        reply = client.messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.output_tokens <= 2
    assert httpx.post(f"{guarded.url}/v1/chat/completions", json={}).status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # operational routes need no key


def test_a_full_queue_answers_429_and_health_stays_fast(guarded: ServerHandle) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    # As long as the context allows: every request must still be in flight when the gauge is read,
    # also on a loaded host (400 tokens could finish first: a queued request then took the slot).
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}], "stream": True, **LONG}
    body["max_tokens"] = 1000
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=30) as client, ExitStack() as streams:
        readers = []  # kept alive: a dropped line iterator closes its response
        for _ in range(guarded.client.capacity):
            response = streams.enter_context(client.stream("POST", "/v1/chat/completions", json=body))
            assert response.status_code == 200
            readers.append(response.iter_lines())
            next(readers[-1])
        rejected = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert rejected.status_code == 429
        assert rejected.headers["Retry-After"] == "1" and "capacity" in rejected.json()["error"]["message"]
        rejected = client.post(
            "/v1/messages", json={"model": MODEL_NAME, "max_tokens": 5, "messages": body["messages"]}
        )
        assert rejected.status_code == 429 and rejected.json()["error"]["type"] == "rate_limit_error"
        for _ in range(5):
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            assert time.monotonic() - start < 0.5
        metrics = client.get("/metrics").text
        assert re.search(r"^deepinfer_requests_rejected_total 2\.0$", metrics, re.M)
        assert re.search(r"^deepinfer_num_requests_in_flight 3\.0$", metrics, re.M)
    guarded.wait_idle()


def test_fifty_clients_disconnecting_mid_stream_free_every_block(server: ServerHandle) -> None:
    server.wait_idle()
    aborted_before = server.metric('deepinfer_requests_total{finish_reason="abort"}')
    blocks_in_use: list[int] = []

    async def client_that_leaves(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"story {i}"}],
            "stream": True,
            **LONG,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data:")
                if chunks == 4:  # the role chunk and three tokens: generation is under way
                    stats = server.client.stats
                    blocks_in_use.append(stats.num_blocks - stats.num_free_blocks)
                    return chunks
        return chunks

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client_that_leaves(client, i) for i in range(50)))

    assert asyncio.run(main()) == [4] * 50
    assert max(blocks_in_use) > 0
    server.wait_idle()
    stats = server.client.stats
    assert stats.num_free_blocks == stats.num_blocks
    assert not server.engine.has_unfinished_requests()
    assert server.metric('deepinfer_requests_total{finish_reason="abort"}') - aborted_before == 50


def test_the_engine_thread_sleeps_when_idle(server: ServerHandle) -> None:
    server.wait_idle()
    engine = server.engine
    calls = 0
    original = engine.has_unfinished_requests

    def counting() -> bool:
        nonlocal calls
        calls += 1
        return original()

    engine.has_unfinished_requests = counting
    try:
        time.sleep(0.5)
        assert calls == 0
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        del engine.has_unfinished_requests
