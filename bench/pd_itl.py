"""Independent control of TTFT and TBT: one aggregated worker (2 torch threads) against one prefill
worker (1 thread) + one decode worker (1 thread) behind the router, on the same Poisson workloads.

Workloads (the same seeds for both setups):

- ``short``: short decodes only: prompts of ``--short-prompt`` tokens, ``--short-output`` tokens out,
  Poisson at ``--short-rate`` per second, streamed (EOS ignored);
- ``mixed``: the same shorts plus long prompts of 4,000-8,000 tokens (uniform), ``--long-output``
  tokens out, Poisson at ``--long-rate`` per second.

Each setup is a ``deepinfer cluster`` (aggregated: ``--both 1 --worker-threads 2``; disaggregated:
``--prefill 1 --decode 1 --worker-threads 1`` with a shared KV store, prompts of 1,024+ tokens taking
the two hops, shorter ones going straight to the decode worker). Setups alternate (A B A B, a fresh
cluster each time) and the figures are medians over repetitions. Measured on the short requests: TTFT,
TPOT and ITL percentiles (ITL: every gap between two streamed tokens); on the long ones: TTFT and
end-to-end. The criterion: the disaggregated setup's short-request ITL p99 with long prompts stays
within 1.5x of its ITL p99 without them.

    PYTHONPATH=. .venv/bin/python bench/pd_itl.py            # ~8 min on a quiet 2-core host
    PYTHONPATH=. .venv/bin/python bench/pd_itl.py --reps 1 --seconds 20   # a quick look

Writes ``bench/results/pd_itl.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from deepinfer.bench.serve import RequestResult, stream_completion, summarise
from deepinfer.bench.sse_client import SSEConnection
from deepinfer.bench.workload import heldout_stream
from deepinfer.model_zoo import default_model_path
from deepinfer.router.cluster import cli_process
from deepinfer.tokenizer import Tokenizer

MODEL = "deepinfer-tiny-coder"
SETUPS = {
    "aggregated": ["--both", "1", "--worker-threads", "2"],
    "disaggregated": [
        *("--prefill", "1", "--decode", "1", "--worker-threads", "1"),
        *("--min-disaggregated-tokens", "1024"),
    ],
}


@contextlib.contextmanager
def cluster(setup: str, work: Path, kv_gib: float) -> Iterator[str]:
    """``deepinfer cluster`` for ``setup``; yields the router URL; SIGTERM at the end."""
    store = work / f"store-{setup}-{time.monotonic_ns()}"
    args = ["--kv-store-path", str(store), "--worker-kv-cache-gib", str(kv_gib), "--serve-args=--max-model-len 8192",
            "--log-level", "warning", "--first-byte-timeout-s", "900", "--request-timeout-s", "1200",
            *SETUPS[setup]]  # fmt: skip
    with cli_process(["cluster", *args], work / f"cluster-{setup}.log", f"the {setup} cluster") as url:
        yield url


def schedule(
    args: argparse.Namespace, mixed: bool, stream: list[int]
) -> list[tuple[float, list[int], int, str]]:
    """(send time, prompt token ids, output tokens, kind) for one run, distinct prompts (no prefix
    shared between requests or runs: each starts at its own offset of the held-out corpus)."""
    rng = random.Random(args.seed)
    out, offset = [], rng.randrange(len(stream) // 2)

    def take(n: int) -> list[int]:
        nonlocal offset
        if offset + n > len(stream):
            offset = 0
        piece = stream[offset : offset + n]
        offset += n
        return piece

    t = 0.0
    while True:
        t += rng.expovariate(args.short_rate)
        if t > args.seconds:
            break
        out.append((t, take(args.short_prompt), args.short_output, "short"))
    if mixed:  # their own draws: the shorts are the same in both workloads
        rng = random.Random(args.seed + 1)
        t = rng.expovariate(args.long_rate)
        while t <= args.seconds:
            out.append((t, take(rng.randint(4000, 8000)), args.long_output, "long"))
            t += rng.expovariate(args.long_rate)
    return sorted(out, key=lambda x: x[0])


async def run(url: str, plan: list[tuple[float, list[int], int, str]]) -> dict[str, list[RequestResult]]:
    address = httpx.URL(url)
    start = time.perf_counter()

    async def one(at: float, prompt: list[int], n: int) -> RequestResult:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        conn = SSEConnection(address.host, address.port)  # one connection a request: none waits on another
        try:
            return await stream_completion(conn, MODEL, prompt, n, None)
        finally:
            conn.close()

    results = await asyncio.gather(*(one(at, prompt, n) for at, prompt, n, _ in plan))
    by_kind: dict[str, list[RequestResult]] = {"short": [], "long": []}
    for (_, _, _, kind), result in zip(plan, results):
        by_kind[kind].append(result)
    return by_kind


def warm(url: str, stream: list[int]) -> None:
    """One short and one long request, so that first-use costs stay out of the measurements."""
    for n in (64, 4096):
        body = {"model": MODEL, "prompt": stream[-n:], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()


def figures(by_kind: dict[str, list[RequestResult]], seconds: float) -> dict:
    short, long = summarise(by_kind["short"], seconds, 0.0), summarise(by_kind["long"], seconds, 0.0)
    keep = ("requests", "completed", "errors", "ttft_s", "tpot_s", "itl_s", "e2e_s")
    return {"short": {k: short[k] for k in keep}, "long": {k: long[k] for k in ("requests", "completed", "errors",
                                                                              "ttft_s", "e2e_s")}}  # fmt: skip


def median_of(runs: list[dict], *path: str) -> float | None:
    values = []
    for r in runs:
        for key in path:
            r = r.get(key, {}) if isinstance(r, dict) else {}
        if isinstance(r, (int, float)):
            values.append(r)
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2, help="repetitions per setup (alternated)")
    parser.add_argument("--seconds", type=float, default=30.0, help="arrival window of each run")
    parser.add_argument("--short-rate", type=float, default=2.0)
    parser.add_argument("--short-prompt", type=int, default=128)
    parser.add_argument("--short-output", type=int, default=48)
    parser.add_argument("--long-rate", type=float, default=0.15)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--kv-gib", type=float, default=0.5, help="KV cache (and host tier) per worker")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/pd_itl.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the clusters on the way out
    stream = heldout_stream(Tokenizer(default_model_path()))
    work = Path(tempfile.mkdtemp(prefix="deepinfer-pd-itl-"))
    runs: dict[str, list[dict]] = {s: [] for s in args.setups}
    started = time.monotonic()
    for rep in range(args.reps):
        for setup in args.setups:
            with cluster(setup, work, args.kv_gib) as url:
                warm(url, stream)
                record = {"rep": rep, "load_before": os.getloadavg()[0]}
                for workload in ("short", "mixed"):
                    plan = schedule(args, workload == "mixed", stream)
                    record[workload] = figures(asyncio.run(run(url, plan)), args.seconds)
                record["load_after"] = os.getloadavg()[0]
                runs[setup].append(record)
                itl = {w: record[w]["short"]["itl_s"].get("p99") for w in ("short", "mixed")}
                print(f"rep {rep} {setup}: short-request ITL p99 {itl}", flush=True)
    summary = {}
    for setup, rs in runs.items():
        s = {
            f"{w}_{m}_{p}": median_of(rs, w, "short", f"{m}_s", p)
            for w in ("short", "mixed")
            for m in ("ttft", "tpot", "itl")
            for p in ("p50", "p90", "p99")
        }
        s["mixed_long_ttft_p50"] = median_of(rs, "mixed", "long", "ttft_s", "p50")
        s["mixed_long_ttft_p99"] = median_of(rs, "mixed", "long", "ttft_s", "p99")
        s["itl_p99_ratio_mixed_over_short"] = (
            s["mixed_itl_p99"] / s["short_itl_p99"] if s["mixed_itl_p99"] and s["short_itl_p99"] else None
        )
        summary[setup] = s
    ratio = summary.get("disaggregated", {}).get("itl_p99_ratio_mixed_over_short")
    result = {
        "what": "short-request ITL/TTFT/TPOT with and without 4k-8k-token prompts: 1 aggregated worker (2 threads) "
        "vs 1 prefill + 1 decode worker (1 thread each), medians over alternated repetitions",
        "args": vars(args),
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "wall_s": time.monotonic() - started,
        "summary": summary,
        "criterion": {
            "disaggregated_itl_p99_ratio": ratio,
            "target": 1.5,
            "met": ratio is not None and ratio <= 1.5,
        },
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {"summary": summary, "criterion": result["criterion"], "wall_s": result["wall_s"]}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
