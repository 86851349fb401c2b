"""``deepinfer cluster`` stopped as a service manager stops it: SIGTERM to its process group (the
router's process; each worker runs in a group of its own) with streams open through the router.
Every stream ends normally, the cluster exits 0, and no worker (nor any engine core) is left."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deepinfer.router.cluster import free_port
from tests.conftest import REPO_ROOT
from tests.server.serve_process import alive, group_members

STREAMS = 3
MAX_TOKENS = 1500


async def stream(url: str, index: int, started: asyncio.Event, counter: list[int]) -> list:
    body = {"model": "deepinfer-tiny-coder", "prompt": f"def f{index}(x):", "max_tokens": MAX_TOKENS}
    body |= {"stream": True, "ignore_eos": True}
    events: list = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    counter[0] += 1
                    if counter[0] == STREAMS:
                        started.set()
    return events


@pytest.mark.slow
def test_sigterm_to_the_cluster_group_drains_every_stream_and_exits_zero(tmp_path: Path) -> None:
    log = tmp_path / "cluster.log"
    port = free_port()
    command = [sys.executable, "-m", "deepinfer.cli", "cluster", "--prefill", "1", "--decode", "1",
               "--kv-store-path", str(tmp_path / "store"), "--worker-threads", "1",
               "--worker-kv-cache-gib", "0.25", "--min-disaggregated-tokens", "4", "--log-level", "warning",
               "--port", str(port)]  # fmt: skip
    env = {**os.environ, "DEEPINFER_CPU_BACKEND": "reference"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"deepinfer cluster exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).json()["status"] == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"not healthy:\n{log.read_text()[-3000:]}"
            time.sleep(0.25)
        workers = [int(p) for p in re.findall(r"worker pid (\d+) at", log.read_text())]
        cores = [
            int(httpx.get(u, timeout=5).json()["engine_cores"]["0"])
            for u in (f"{w}/health" for w in re.findall(r"worker pid \d+ at (\S+)", log.read_text()))
        ]
        assert len(workers) == 2 and len(cores) == 2

        async def scenario() -> list[list]:
            started, counter = asyncio.Event(), [0]
            tasks = [asyncio.create_task(stream(url, i, started, counter)) for i in range(STREAMS)]
            await asyncio.wait_for(started.wait(), 120)
            os.killpg(proc.pid, signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(scenario())
        for events in results:
            assert events[-1] == "[DONE]", events[-3:]
            assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
            reasons = [
                c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")
            ]
            assert reasons == ["length"]
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in workers + cores) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers + cores if alive(pid)], (
            "worker or core processes outlived the cluster"
        )
        assert not group_members(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in workers:  # each worker leads its own group
            if group_members(pid):
                os.killpg(pid, signal.SIGKILL)
