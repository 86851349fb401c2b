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
import dataclasses
import json
import os
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from deepinfer.bench.offline import percentile
from deepinfer.bench.sse_client import SSEConnection
from deepinfer.router.cluster import LOOPBACK, cli_process

REQUEST_TIMEOUT_S = 600.0  # a closed-loop request that takes longer fails the run


@dataclass(slots=True)
class RequestResult:
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def _endpoint(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"--url {url!r}: the load generator speaks plain http:// (e.g. http://127.0.0.1:8000)"
        )
    return parts.hostname, parts.port or 80


async def stream_completion(
    conn: SSEConnection, model: str, prompt: list[int], output_len: int, api_key: str | None
) -> RequestResult:
    """Stream one completion; a token's time is when the bytes of its event arrived."""
    result = RequestResult()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()

    def on_event(data: bytes) -> None:
        if data == b"[DONE]":
            return
        if data.startswith(b'{"error"'):
            result.error = f"error event: {data[:200]!r}"
        elif b'"usage":' in data:  # once per request: the only chunk decoded
            chunk = json.loads(data)
            result.output_tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or []):
                result.token_times.append(time.perf_counter() - start)
        elif (
            b'"text":""' not in data
        ):  # a chunk with text: at least one token (raw JSON: quotes are escaped in strings)
            result.token_times.append(time.perf_counter() - start)

    try:
        response = await conn.post("/v1/completions", json.dumps(body).encode(), on_event, headers)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.body[:200]!r}"
    except Exception as exc:  # a benchmark records failures instead of dying on the first one
        result.error = f"{type(exc).__name__}: {exc}"
    if result.token_times:
        result.ttft_s = result.token_times[0]
    result.end_s = time.perf_counter() - start
    return result


async def run_load(
    url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float, max_seconds: float,
    seed: int = 0, api_key: str | None = None,
) -> dict:  # fmt: skip
    """Send the prompts with exponential inter-arrival gaps (``request_rate`` per second), each on
    its own connection."""
    host, port = _endpoint(url)
    rng = random.Random(seed)
    tasks = []

    async def one(prompt: list[int]) -> RequestResult:
        conn = SSEConnection(host, port)
        try:
            return await asyncio.wait_for(
                stream_completion(conn, model, prompt, output_len, api_key), max_seconds + 60
            )
        finally:
            conn.close()

    start = time.perf_counter()
    for prompt in prompts:
        if time.perf_counter() - start > max_seconds:
            break
        tasks.append(asyncio.create_task(one(prompt)))
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
    """Closed loop: ``concurrency`` clients, each on its own keep-alive connection, sending its next
    prompt as soon as its last one finished (saturation when ``concurrency`` covers the engine's batch)."""
    host, port = _endpoint(url)
    pending = list(reversed(prompts))
    results: list[RequestResult] = []

    async def client_loop() -> None:
        conn = SSEConnection(host, port)
        try:
            while pending:
                request = stream_completion(conn, model, pending.pop(), output_len, api_key)
                results.append(await asyncio.wait_for(request, REQUEST_TIMEOUT_S))
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    summary = summarise(results, time.perf_counter() - start, float("inf"))
    summary["concurrency"] = concurrency
    return summary


def compare_offline(url: str, model: str, llm, workload, concurrency: int, reps: int) -> dict:
    """``deepinfer bench serve`` against ``deepinfer bench offline`` on the same prompts, alternating
    (offline, served, offline, served, ...): output tokens/s of each run, medians, and their ratio.
    Rep ``i`` sends the workload's prompts for seed ``workload.seed + i`` to both sides: a rep that
    re-sent the last rep's prompts would find them in both engines' prefix caches and measure mostly
    decoding, not the workload (each offline rep records its cached prompt tokens: about 0).
    ``llm``: an in-process ``LLM`` built with the server's engine options (its ``max_num_seqs`` no
    larger than ``concurrency``, so both sides run the same batch). Each rep also records the
    host's load average and, for a server on this host, the CPU seconds per output token of the
    bench client, the API front and the engine core(s): where the served side's CPU went. On a
    loaded host the wall-clock ratio favours the served side (three processes get more of the
    scheduler than one); ``offline_over_served_cpu_per_token`` (median over reps) does not."""
    from deepinfer.bench.offline import run_offline

    pids = _server_pids(url)
    offline, served, offline_reps, served_reps = [], [], [], []
    for rep in range(reps):
        prompts = dataclasses.replace(workload, seed=workload.seed + rep).prompts(llm.engine.tokenizer)
        load, cpu = os.getloadavg()[0], time.process_time()
        result = run_offline(llm, workload, prompts)
        tokens = result["output_tokens"]
        offline.append(result["output_tokens_per_s"])
        offline_reps.append({"output_tokens_per_s": offline[-1], "wall_s": result["wall_s"], "load_average": load,
                             "cpu_us_per_token": 1e6 * (time.process_time() - cpu) / tokens,
                             "cached_prompt_tokens": result["cached_prompt_tokens"], "seed": workload.seed + rep})  # fmt: skip
        load, before = os.getloadavg()[0], _cpu_seconds(pids)
        run = asyncio.run(run_concurrent(url, model, prompts, workload.output_len, concurrency))
        if run["completed"] != len(prompts):
            raise RuntimeError(f"served run lost requests: {run['errors']}")
        after = _cpu_seconds(pids)
        served.append(run["output_tokens_per_s"])
        served_reps.append({
            "output_tokens_per_s": served[-1], "wall_s": run["wall_s"], "load_average": load,
            "cpu_us_per_token": {k: 1e6 * (after[k] - before[k]) / run["output_tokens"] for k in after},
        })  # fmt: skip
    off, srv = statistics.median(offline), statistics.median(served)
    cpu_ratio = None  # offline CPU per token over the served side's (client + front + cores): load-robust
    if pids:
        cpu_ratio = statistics.median(
            o["cpu_us_per_token"] / sum(s["cpu_us_per_token"].values())
            for o, s in zip(offline_reps, served_reps)
        )
    return {
        "offline_output_tokens_per_s": offline,
        "served_output_tokens_per_s": served,
        "offline_median": off,
        "served_median": srv,
        "served_over_offline": srv / off,
        "offline_over_served_cpu_per_token": cpu_ratio,
        "concurrency": concurrency,
        "reps": reps,
        "offline_reps": offline_reps,
        "served_reps": served_reps,
        "last_served_run": run,
        "env": result["env"],
    }


def _server_pids(url: str) -> dict[str, int]:
    """The front's and the engine cores' process ids from ``/health`` (kept if they run on this host)."""
    import httpx

    health = httpx.get(f"{url}/health", timeout=10).json()
    pids = {"front": health["pid"], **{f"core{i}": pid for i, pid in health["engine_cores"].items()}}
    return {name: pid for name, pid in pids.items() if os.path.exists(f"/proc/{pid}/stat")}


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of this process (``client``) and of each process in ``pids``."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = {"client": usage.ru_utime + usage.ru_stime}
    tick = os.sysconf("SC_CLK_TCK")
    for name, pid in pids.items():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        seconds[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (proc(5))
    return seconds


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


@contextlib.contextmanager
def launch(model: str, server_args: list[str], timeout_s: float = 300) -> Iterator[str]:
    """Start ``deepinfer serve`` on a free loopback port; yields its base URL; stops it afterwards
    (its output goes to a temporary file, quoted in the error if it fails to start)."""
    args = ["serve", "--model", model, "--host", LOOPBACK, "--log-level", "warning", *server_args]
    with (
        tempfile.TemporaryDirectory(prefix="deepinfer-bench-serve-") as folder,
        cli_process(args, Path(folder) / "serve.log", "deepinfer serve", timeout_s) as url,
    ):
        yield url
