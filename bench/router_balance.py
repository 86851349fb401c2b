"""Balance of the router's prefill policies, side by side: estimated compute vs round-robin vs
least-requests, on the same workers and the same skewed prompt-length workload.

Starts N both-role workers (1 torch thread each) with ``deepinfer.router.cluster``, then for each
repetition runs every policy in turn (A B C A B C: the machine is shared and noisy) behind a fresh
``deepinfer router`` process. Each run sends the same prompt lengths (new random tokens per run, so no
run hits another's prefix cache) as Poisson arrivals of ``/v1/completions`` with a few output tokens,
so the work is prompt compute. Every request is routed by the prefill policy
(``--min-disaggregated-tokens 0``). Balance = perfect makespan (LPT, offline, full knowledge) /
achieved makespan (the busiest worker's busy time), from ``deepinfer.router.measure``; with
``--disaggregated`` over the prefill workers (the pool the prefill policy places prompts on; the
decode pool's balance is printed beside it). Also reported: the placement balance, the same ratio on
predicted costs of where each prompt went (the router names the prefill worker of a two-hop answer),
free of the timing noise of a shared machine. ``--policies`` can add
``estimated-compute-at-arrival`` (ours with each request placed at arrival, no late binding). Prints
one line per run, then the medians per policy and the load average seen; ``--out`` writes the JSON.

    PYTHONPATH=$PWD .venv/bin/python bench/router_balance.py --out bench/results/router_balance.json
    PYTHONPATH=$PWD .venv/bin/python bench/router_balance.py --disaggregated --rate 64 --requests 96 \
        --out bench/results/router_balance_pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.balance import balance, request_cost
from deepinfer.router.cluster import cli_process, workers_running
from deepinfer.router.measure import BusyMeter
from deepinfer.router.proxy import PREFILL_WORKER_HEADER, WORKER_HEADER

POLICIES = ("estimated-compute", "round-robin", "least-requests")
# the estimated-compute policy with each request placed at arrival (no late binding), for comparison
AT_ARRIVAL = "estimated-compute-at-arrival"
ROUTER_FLAGS = {AT_ARRIVAL: ["--prefill-policy", "estimated-compute", "--prefill-queue-limit", "0"]}


def skewed_lengths(n: int, low: int, high: int, alpha: float, seed: int) -> list[int]:
    """Pareto(alpha) prompt lengths from ``low``, clipped at ``high``: most short, a few very long."""
    rng = random.Random(seed)
    return [min(high, int(low / (1.0 - rng.random()) ** (1.0 / alpha))) for _ in range(n)]


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


async def send(
    url: str, model: str, batch: list[list[int]], output_len: int, rate: float, seed: int
) -> list[str | None]:
    """Send the prompts as Poisson arrivals; the worker that computed each prompt (the prefill
    worker of a two-hop request, else the one that answered; ``None``: it failed)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:

        async def one(p: list[int]) -> str | None:
            body = {
                "model": model,
                "prompt": p,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code != 200:
                return None
            return r.headers.get(PREFILL_WORKER_HEADER) or r.headers.get(WORKER_HEADER)

        tasks = []
        for p in batch:
            tasks.append(asyncio.create_task(one(p)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def placement(
    served: list[str | None], lengths: list[int], urls: list[str], model, output_len: int, prompts_only: bool
) -> float:
    """Balance of where the router put the work, by predicted cost (no timing noise): LPT makespan of
    the predicted costs / the largest predicted cost placed on one worker. ``prompts_only``: the
    workers only compute prompts (prefill workers), so a job is its prompt."""
    if prompts_only:
        costs = [model.marginal(n, 0) for n in lengths]
    else:
        costs = [request_cost(model, n, output_len) for n in lengths]
    placed = dict.fromkeys(urls, 0.0)
    for worker, cost in zip(served, costs):
        if worker is not None:
            placed[worker] += cost
    return balance(placed, costs).balance


def router_args(urls: list[str], policy: str, model: str | None, decode: list[str] = ()) -> list[str]:
    """``deepinfer router`` over ``urls`` (both-role workers, or prefill workers when ``decode`` is given)."""
    pool = ["--prefill", *urls, "--decode", *decode] if decode else ["--both", *urls]
    flags = ROUTER_FLAGS.get(policy, ["--prefill-policy", policy])
    return ["router", *pool, *flags, "--min-disaggregated-tokens", "0", "--log-level", "warning",
            *(["--model", model] if model else [])]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the bundled deepinfer-tiny-coder)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="--workers prefill + --workers decode workers on a shared KV store (every request two hops)",
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=3072)
    parser.add_argument(
        "--alpha", type=float, default=1.1, help="Pareto shape of prompt lengths (smaller: more skew)"
    )
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--rate", type=float, default=16.0, help="arrivals per second")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=[*POLICIES, AT_ARRIVAL],
        help=f"run in this order each repetition ({AT_ARRIVAL}: ours without late binding)",
    )
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args()

    from deepinfer.model_zoo import default_model_path

    model = str(args.model or default_model_path())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    name = Path(model).name
    lengths = skewed_lengths(args.requests, args.min_len, args.max_len, args.alpha, args.seed)
    serve_args = ["--kv-cache-memory-gib", "0.5", "--max-model-len", str(args.max_len + args.output_len + 16)]
    with tempfile.TemporaryDirectory(prefix="deepinfer-balance-") as folder:
        work = Path(folder)
        runs = []
        counts = (
            {"prefill": args.workers, "decode": args.workers}
            if args.disaggregated
            else {"both": args.workers}
        )
        if args.disaggregated:
            serve_args += ["--kv-shared-path", str(work / "store")]
        with workers_running(counts, model, serve_args, threads=1) as workers:
            urls = [w.url for w in workers if w.role != "decode"]
            decode = [w.url for w in workers if w.role == "decode"]
            for rep in range(args.reps):
                for i, policy in enumerate(args.policies):
                    with cli_process(
                        router_args(urls, policy, args.model, decode), work / "router.log", "the router", 60
                    ) as url:
                        meter = BusyMeter.attach(url)
                        batch = prompts(lengths, vocab, seed=args.seed + 1000 * rep + i + 1)
                        started = time.perf_counter()
                        served = asyncio.run(
                            send(url, name, batch, args.output_len, args.rate, args.seed + rep)
                        )
                        wall = time.perf_counter() - started
                        result = meter.finish([(n, args.output_len) for n in lengths])
                        status = httpx.get(f"{url}/router/workers").json()
                        cost_model = StepCostModel(**status[urls[0]]["cost_model"])
                        slowdown = {u: status[u]["prefill_slowdown"] for u in urls}
                        placed = placement(served, lengths, urls, cost_model, args.output_len, bool(decode))
                    ok = sum(w is not None for w in served)
                    run = {"rep": rep, "policy": policy, "completed": ok, "wall_s": wall, "load_avg_1m": os.getloadavg()[0],
                           **result, "placement_balance": placed, "prefill_slowdown": slowdown,
                           "prompt_workers": [urls.index(w) if w in urls else None for w in served]}  # fmt: skip
                    runs.append(run)
                    decode_part = f", decode pool {result['decode_balance']:.3f}" if decode else ""
                    print(f"rep {rep} {policy:>28}: balance {result['balance']:.3f} (placement {placed:.3f}{decode_part}), "
                          f"busy {sorted(round(v, 2) for v in result['busy_s'].values())} s, {ok}/{len(lengths)} ok, "
                          f"wall {wall:.1f} s, slowdown {[round(v, 2) for v in slowdown.values()]}, "
                          f"load {run['load_avg_1m']:.1f}", flush=True)  # fmt: skip
    summary = {p: statistics.median(r["balance"] for r in runs if r["policy"] == p) for p in args.policies}
    placed = {
        p: statistics.median(r["placement_balance"] for r in runs if r["policy"] == p) for p in args.policies
    }
    loads = [r["load_avg_1m"] for r in runs]
    for policy, value in summary.items():
        print(f"median balance {policy:>28}: {value:.3f} (placement {placed[policy]:.3f})")
    print(f"load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}")
    if args.out:
        out = {"config": vars(args), "prompt_lengths": lengths, "median_balance": summary,
               "median_placement_balance": placed, "runs": runs}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
