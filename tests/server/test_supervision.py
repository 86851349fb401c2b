"""The engine core as a supervised process: SIGKILL it under 32 streaming clients of all four APIs
(every client gets an error in its API's shape within 5 s, the server exits non-zero, no process is
left), or with ``--restart-engine`` watch the server serve again; SIGTERM drains, sent to the
server alone or to its whole process group (as ``timeout``, systemd and container runtimes do)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.serve_process import Served, alive, group_members, serve

NAME = "tiny"
USER = [{"role": "user", "content": "tell me a long story"}]


def body(api: str, max_tokens: int) -> tuple[str, dict]:
    """A streaming request of ``api`` that generates ``max_tokens`` tokens unless EOS comes first."""
    if api == "chat":
        return "/v1/chat/completions", {"model": NAME, "messages": USER, "max_tokens": max_tokens, "stream": True,
                                        "ignore_eos": True}  # fmt: skip
    if api == "completions":
        return "/v1/completions", {"model": NAME, "prompt": "def f(x):", "max_tokens": max_tokens, "stream": True,
                                   "ignore_eos": True}  # fmt: skip
    if api == "responses":
        return "/v1/responses", {
            "model": NAME,
            "input": USER,
            "max_output_tokens": max_tokens,
            "stream": True,
        }
    return "/v1/messages", {"model": NAME, "messages": USER, "max_tokens": max_tokens, "stream": True}


APIS = ("chat", "completions", "responses", "messages")


@dataclass
class Stream:
    api: str
    started: asyncio.Event = field(default_factory=asyncio.Event)
    events: list = field(default_factory=list)
    ended_at: float | None = None
    status: int | None = None

    @property
    def errored(self) -> bool:
        """Ended with an error event in its API's own shape ([DONE] after it where the API uses it)."""
        last = [e for e in self.events if e != "[DONE]"][-1:] or [None]
        if self.api in ("chat", "completions"):
            return isinstance(last[0], dict) and "error" in last[0] and self.events[-1] == "[DONE]"
        return isinstance(last[0], dict) and last[0].get("type") == "error"

    @property
    def finished_normally(self) -> bool:
        kinds = [e.get("type") for e in self.events if isinstance(e, dict)]
        if self.api in ("chat", "completions"):
            return self.events[-1:] == ["[DONE]"] and not any(
                "error" in e for e in self.events if isinstance(e, dict)
            )
        final = "message_stop" if self.api == "messages" else ("response.completed", "response.incomplete")
        return bool(kinds) and kinds[-1] in (final if isinstance(final, tuple) else (final,))


async def run_stream(client: httpx.AsyncClient, stream: Stream, max_tokens: int) -> None:
    import json

    path, request = body(stream.api, max_tokens)
    try:
        async with client.stream("POST", path, json=request) as response:
            stream.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    stream.events.append(data if data == "[DONE]" else json.loads(data))
                    if len(stream.events) >= 3:
                        stream.started.set()
    except httpx.HTTPError as exc:
        stream.events.append(f"transport error: {exc!r}")
    finally:
        stream.ended_at = time.monotonic()
        stream.started.set()


async def streams_then(served: Served, per_api: int, max_tokens: int, action) -> tuple[list[Stream], float]:
    """Start ``per_api`` streams of each API, wait until all are generating, run ``action()``;
    returns the streams (once ended) and when the action ran."""
    streams = [Stream(api) for api in APIS for _ in range(per_api)]
    limits = httpx.Limits(max_connections=len(streams) + 8)
    async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(run_stream(client, s, max_tokens)) for s in streams]
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 90)
        assert all(s.ended_at is None for s in streams), "a stream ended before the action"
        acted = time.monotonic()
        await action()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return streams, acted


def failed_by_the_kill(streams: list[Stream], killed: float, within_s: float = 1.0) -> list[Stream]:
    """The streams the kill (or cut) must have failed: all but those of the two APIs without
    ``ignore_eos`` (Responses, Messages) that reached EOS and ended normally within ``within_s`` of
    it (the engine had finished them first). Asserts that no other stream ended normally."""
    eos_before_kill = [
        s
        for s in streams
        if s.api in ("responses", "messages") and s.finished_normally and s.ended_at - killed < within_s
    ]
    failed = [s for s in streams if s not in eos_before_kill]
    wrong = [(s.api, s.events[-2:]) for s in failed if not s.errored]
    assert not wrong, f"streams that did not end with an error event: {wrong[:4]}"
    assert len(failed) >= len(streams) // 2
    return failed


def kill_core(served: Served) -> int:
    pid = served.core_pid()
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_a_killed_engine_core_fails_every_stream_and_the_server_exits_non_zero(deepseek_model: Path) -> None:
    with serve(deepseek_model) as served:
        pids = {}

        async def kill() -> None:
            pids["core"] = kill_core(served)

        streams, killed = asyncio.run(streams_then(served, 8, 900, kill))
        late = [(s.api, round(s.ended_at - killed, 2)) for s in streams if s.ended_at - killed > 5]
        assert not late, f"streams that did not end within 5 s of the kill: {late}"
        failed = failed_by_the_kill(streams, killed)
        assert all("engine" in str(s.events[-2 if s.api in ("chat", "completions") else -1]) for s in failed)
        served.proc.wait(timeout=15)
        assert served.proc.returncode != 0
        assert not alive(pids["core"])
        assert "the engine failed" in served.output and "killed by SIGKILL" in served.output


@pytest.mark.slow
def test_with_restart_engine_the_server_serves_again(deepseek_model: Path) -> None:
    """Also: with --front-nice 10 the front runs at nice +10, its engine core, restarted too, at the
    priority the server was started with."""
    base = os.nice(0)
    with serve(deepseek_model, "--restart-engine", "--front-nice", "10") as served:
        assert os.getpriority(os.PRIO_PROCESS, served.proc.pid) == min(19, base + 10)
        assert os.getpriority(os.PRIO_PROCESS, served.core_pid()) == base
        seen = {}

        async def kill() -> None:
            seen["core"] = kill_core(served)
            start = time.monotonic()
            while time.monotonic() - start < 2:
                response = await asyncio.to_thread(served.health)
                if response.status_code == 503:
                    seen["503_after_s"] = time.monotonic() - start
                    return
                await asyncio.sleep(0.05)

        streams, killed = asyncio.run(streams_then(served, 2, 900, kill))
        assert "503_after_s" in seen, "/health did not answer 503 within 2 s of the kill"
        failed_by_the_kill(streams, killed)
        assert all(s.ended_at - killed < 5 for s in streams), [s.ended_at - killed for s in streams]
        assert served.wait_healthy(30) < 30
        assert served.core_pid() != seen["core"] and not alive(seen["core"])
        assert os.getpriority(os.PRIO_PROCESS, served.core_pid()) == base
        reply = httpx.post(
            f"{served.url}/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 4}
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        assert served.proc.poll() is None


@pytest.mark.slow
def test_sigterm_lets_active_streams_finish_then_exits_zero(deepseek_model: Path) -> None:
    with serve(deepseek_model, "--drain-timeout", "120") as served:
        seen = {}

        async def terminate() -> None:
            served.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=served.url) as client:
                late = await client.post(
                    "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}
                )
                seen["late"] = late
                seen["health"] = await client.get("/health")

        # Streams long enough to outlast the late request (0.3 s after the signal): a decode step of 8
        # streams takes a few milliseconds here, so 64 tokens could drain, and the server exit, first.
        streams, _ = asyncio.run(streams_then(served, 2, 600, terminate))
        assert seen["late"].status_code == 503 and seen["late"].headers["Retry-After"] == "1"
        assert seen["health"].status_code == 503
        unfinished = [(s.api, s.events[-2:]) for s in streams if not s.finished_normally]
        assert not unfinished, unfinished
        assert served.proc.wait(timeout=30) == 0, served.output[-2000:]


def test_sigterm_past_the_drain_timeout_cuts_streams_with_an_error(deepseek_model: Path) -> None:
    with serve(deepseek_model, "--drain-timeout", "0.5") as served:

        async def terminate() -> None:
            served.proc.send_signal(signal.SIGTERM)

        streams, terminated = asyncio.run(streams_then(served, 2, 900, terminate))
        failed = failed_by_the_kill(streams, terminated, within_s=1.5)
        assert all("drain timeout" in str(s.events) for s in failed)
        assert served.proc.wait(timeout=30) == 0, served.output[-2000:]


def test_sigterm_to_the_process_group_drains_every_stream_and_exits_zero(deepseek_model: Path) -> None:
    """The engine core gets the group's SIGTERM too: it used to die of it (its streams failed with
    "the engine failed", exit 1); it ignores it, and its front stops it after the drain."""
    with serve(deepseek_model, "--drain-timeout", "120", new_session=True) as served:
        pgid = served.proc.pid
        seen = {}

        async def terminate() -> None:
            seen["core"] = served.core_pid()
            assert sorted(group_members(pgid)) == sorted([pgid, seen["core"]])
            os.killpg(pgid, signal.SIGTERM)
            await asyncio.sleep(0.5)
            seen["core_alive"] = alive(seen["core"])

        streams, _ = asyncio.run(streams_then(served, 1, 300, terminate))
        unfinished = [(s.api, s.events[-2:]) for s in streams if not s.finished_normally]
        assert not unfinished, unfinished
        assert seen["core_alive"], "the engine core died of the group's SIGTERM"
        assert served.proc.wait(timeout=60) == 0, served.output[-2000:]
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_members(pgid), f"left in the server's process group: {group_members(pgid)}"
        assert not alive(seen["core"])
