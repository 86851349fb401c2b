"""Serving load generator: Poisson arrivals (or a closed loop of N clients) against a running
``deepinfer serve``, loopback only; ``compare_offline`` measures it side by side with the offline
engine on the same prompts.

Each request streams an OpenAI completion of a workload prompt (token ids, EOS ignored, a fixed output
length), so the measurements are the server's: time to first token, time per output token (after the
first), inter-token latencies, end-to-end latency, and output throughput. Bounded in count and time.
``launch`` starts a server as a subprocess on a free loopback port for a self-contained run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from deepinfer.bench.offline import percentile

LOOPBACK = "127.0.0.1"


@dataclass(slots=True)
class RequestResult:
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


async def _one(
    client, url: str, model: str, prompt: list[int], output_len: int, api_key: str | None
) -> RequestResult:
    result = RequestResult()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter() - start
                    if result.ttft_s is None:
                        result.ttft_s = now
                    result.token_times.append(now)
    except Exception as exc:  # a benchmark records failures instead of dying on the first one
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = time.perf_counter() - start
    return result


async def run_load(
    url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float, max_seconds: float,
    seed: int = 0, api_key: str | None = None,
) -> dict:  # fmt: skip
    """Send the prompts with exponential inter-arrival gaps (``request_rate`` per second)."""
    import httpx

    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_seconds + 60), limits=limits) as client:
        for prompt in prompts:
            if time.perf_counter() - start > max_seconds:
                break
            tasks.append(asyncio.create_task(_one(client, url, model, prompt, output_len, api_key)))
            await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    return summarise(results, wall, request_rate)


async def run_concurrent(
    url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    api_key: str | None = None,
) -> dict:
    """Closed loop: ``concurrency`` clients, each sending its next prompt as soon as its last one
    finished (saturation when ``concurrency`` covers the engine's batch)."""
    import httpx

    pending = list(reversed(prompts))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client_loop(client) -> None:
        while pending:
            results.append(await _one(client, url, model, pending.pop(), output_len, api_key))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    summary = summarise(results, time.perf_counter() - start, float("inf"))
    summary["concurrency"] = concurrency
    return summary


def compare_offline(
    url: str, model: str, llm, workload, prompts: list[list[int]], concurrency: int, reps: int
) -> dict:
    """``deepinfer bench serve`` against ``deepinfer bench offline`` on the same prompts, alternating
    (offline, served, offline, served, ...): output tokens/s of each run, medians, and their ratio.
    ``llm``: an in-process ``LLM`` built with the server's engine options."""
    from deepinfer.bench.offline import run_offline

    offline, served = [], []
    for _ in range(reps):
        result = run_offline(llm, workload, prompts)
        offline.append(result["output_tokens_per_s"])
        run = asyncio.run(run_concurrent(url, model, prompts, workload.output_len, concurrency))
        if run["completed"] != len(prompts):
            raise RuntimeError(f"served run lost requests: {run['errors']}")
        served.append(run["output_tokens_per_s"])
    off, srv = statistics.median(offline), statistics.median(served)
    return {
        "offline_output_tokens_per_s": offline,
        "served_output_tokens_per_s": served,
        "offline_median": off,
        "served_median": srv,
        "served_over_offline": srv / off,
        "concurrency": concurrency,
        "reps": reps,
        "last_served_run": run,
        "env": result["env"],
    }


def summarise(results: list[RequestResult], wall: float, request_rate: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.end_s - r.ttft_s) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.end_s for r in ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
                "p99": percentile(values, 99)}  # fmt: skip

    return {
        "request_rate": request_rate,
        "requests": len(results),
        "completed": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall,
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "itl_s": stats(itl),
        "e2e_s": stats(e2e),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch(model: str, server_args: list[str], timeout_s: float = 300) -> Iterator[str]:
    """Start ``deepinfer serve`` on a free loopback port; yields its base URL; stops it afterwards."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", model, "--host", LOOPBACK, "--port", str(port),
           "--log-level", "warning", *server_args]  # fmt: skip
    # a file, not a pipe: a chatty server never blocks on it; closed in the finally below
    errors = tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env={**os.environ}, stderr=errors, text=True)
    url = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                errors.seek(0)
                raise RuntimeError(f"deepinfer serve exited ({proc.returncode}): {errors.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"deepinfer serve did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        errors.close()
