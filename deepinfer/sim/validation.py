"""Check the simulator against our own serving stack: the same traces replayed through real engine
processes on this machine and through the simulator calibrated on this machine.

Two setups, each started once and fed two traces (Poisson arrivals of code prompts that share
prefixes: one of a few shared file headers, Zipf-popular, then the request's own window of held-out
code; a fixed output length, EOS ignored), a *calibration* trace and a *held-out* one, whose prompts
share no prefix with each other:

- ``aggregated``: one ``deepinfer serve`` (one engine thread) with a step time budget;
- ``disaggregated``: ``deepinfer cluster`` with one prefill and one decode worker (one thread each)
  behind the router, every prompt taking the two hops (prefill, KV handoff through the shared store,
  decode).

Every engine core writes its step log (``DEEPINFER_STEP_LOG_DIR``, :mod:`deepinfer.core.step_log`):
each step's composition ((new, cached) tokens per request), its start and end and the model
runner's share, and each request's arrival at the core. From the *calibration trace only*
(:func:`fit_served_steps`, :func:`fit_front`, :func:`fit_handoff`) come:

- the served step's period (one step's start to the next's, so the core loop's messaging is in it)
  and the runner's share, each a :class:`~deepinfer.engine.cost_model.StepCostModel` fitted by least
  squares (relative error) to the real steps' compositions, and per batch size the period's mean
  residual on decode-only steps (:func:`batch_residuals`: the served step is not linear in its batch);
- the API front's latency in (client send -> the core has the request, on requests that found the
  core idle, so that no step delayed them) and out (the step that produced a token -> the client has
  it), medians;
- for the P/D setup, the KV handoff: the prefill worker's step end -> the decode worker's first step
  with the request, fitted as a latency plus a per-token cost over the tokens handed over.

The simulator then replays both traces (the measured send times as arrivals) with the engine's
scheduler cutting prompt chunks with each server's own start-up cost model (read from its ``GET
/load``: two workers calibrating at one start differ), the fitted step models as the clock, and the
router's own policies and late-binding prefill queue (P/D only: the aggregated server has no router
in front); nothing is refitted on the held-out trace. The report has, per setup and trace, TTFT
p50/p90, TPOT p50/p90 (per output token on both sides) and output throughput, measured and
simulated, and their errors; the step models' error on the held-out trace's own steps; and how the
served steps compare with the start-up calibration the old validation used alone (the reason it was
pessimistic).
:func:`run_validation` can record a run (``keep``: the step logs and what the client saw) for
:func:`recheck` to fit and simulate again without serving.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from deepinfer import envs
from deepinfer.core.step_log import read_step_log
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.config import RouterConfig
from deepinfer.sim.cluster import ClusterConfig, EngineKnobs, PoolConfig, Simulation
from deepinfer.sim.costs import CalibratedCost
from deepinfer.sim.report import percentile
from deepinfer.sim.workload import Arrival, Segment

METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))
SETUPS = ("aggregated", "disaggregated")


@dataclass(frozen=True, slots=True)
class TraceSpec:
    num_requests: int = 100
    request_rate: float = 3.0
    output_len: int = 96
    shared_prefixes: int = 6
    prefix_len: int = 384
    suffix_len: tuple[int, int] = (32, 512)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    step_time_budget_ms: float = 100.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_cache_memory_gib: float = 1.0

    def args(self, with_cache: bool = True) -> list[str]:
        """``deepinfer serve`` options (``with_cache``: the KV cache size too; a cluster sets it)."""
        out = [
            "--step-time-budget-ms", str(self.step_time_budget_ms),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-num-seqs", str(self.max_num_seqs),
        ]  # fmt: skip
        return out + (["--kv-cache-memory-gib", str(self.kv_cache_memory_gib)] if with_cache else [])


def build_prompts(stream: list[int], spec: TraceSpec) -> list[list[int]]:
    """Prompts of ``spec``: a shared prefix (Zipf-popular) + the request's own code window."""
    rng = random.Random(f"prompts/{spec.seed}")
    lo, hi = spec.suffix_len
    starts = [rng.randrange(len(stream) - spec.prefix_len) for _ in range(spec.shared_prefixes)]
    prefixes = [stream[s : s + spec.prefix_len] for s in starts]
    weights = [1 / (k + 1) for k in range(spec.shared_prefixes)]
    prompts = []
    for _ in range(spec.num_requests):
        prefix = rng.choices(prefixes, weights)[0]
        n = rng.randint(lo, hi)
        s = rng.randrange(len(stream) - n)
        prompts.append(prefix + stream[s : s + n])
    return prompts


def arrival_times(spec: TraceSpec) -> list[float]:
    """Send offsets (seconds from the trace's start): exponential gaps at ``request_rate``."""
    rng = random.Random(spec.seed)
    times, t = [], 0.0
    for _ in range(spec.num_requests):
        times.append(t)
        t += rng.expovariate(spec.request_rate)
    return times


# ---------------------------------------------------------------------------------- the real side
@dataclass(slots=True)
class Served:
    """One trace through the real stack: per request (in send order) its prompt, its send time and
    what the client saw (``deepinfer.bench.serve.RequestResult``, times relative to the send);
    absolute times are ``time.perf_counter()`` (the step logs' clock)."""

    prompts: list[list[int]]
    sends: list[float]
    results: list
    load_average: tuple[tuple[float, ...], tuple[float, ...]]

    @property
    def start(self) -> float:
        return self.sends[0]

    @property
    def end(self) -> float:
        return max(s + r.end_s for s, r in zip(self.sends, self.results))

    def figures(self) -> dict:
        """The trace's figures: TTFT and throughput as the load generator
        (``deepinfer.bench.serve.summarise``) has them, TPOT per output token, (last token - first) /
        (output tokens - 1), the simulator's definition. The load generator's own TPOT divides by the
        SSE events that carried text, and a front that falls behind its engine sends several tokens
        in one event (up to a fifth fewer events than tokens here under load); that figure is kept as
        ``tpot_per_event_p50``/``_p90``, for the record only."""
        from deepinfer.bench.serve import summarise

        errors = [r.error for r in self.results if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests of the trace failed, e.g. {errors[0]}")
        summary = summarise(self.results, self.end - self.start, 0.0)
        figures = _figures(summary)
        tpot = [(r.end_s - r.ttft_s) / (r.output_tokens - 1) for r in self.results if r.output_tokens > 1]
        for q in ("p50", "p90"):
            figures[f"tpot_per_event_{q}"] = figures[f"tpot_{q}"]
            figures[f"tpot_{q}"] = percentile(tpot, int(q[1:]))
        return figures


async def _replay(url: str, model: str, prompts: list[list[int]], offsets: list[float], output_len: int):
    """Send each prompt at its offset from now, on its own connection; (send times, results)."""
    from urllib.parse import urlsplit

    from deepinfer.bench.serve import stream_completion
    from deepinfer.bench.sse_client import SSEConnection

    parts = urlsplit(url)
    start = time.perf_counter()
    sends = [0.0] * len(prompts)

    async def one(i: int):
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        conn = SSEConnection(parts.hostname, parts.port)
        try:
            sends[i] = time.perf_counter()
            return await asyncio.wait_for(stream_completion(conn, model, prompts[i], output_len, None), 600)
        finally:
            conn.close()

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return sends, results


def serve_trace(url: str, model: str, prompts: list[list[int]], spec: TraceSpec) -> Served:
    load_before = os.getloadavg()
    sends, results = asyncio.run(_replay(url, model, prompts, arrival_times(spec), spec.output_len))
    return Served(prompts, sends, list(results), (load_before, os.getloadavg()))


def _warm(url: str, model: str, stream: list[int]) -> None:
    """Two requests whose prompts no trace shares, so that first-use costs stay out of the traces."""
    import httpx

    for n in (700, 300):
        body = {"model": model, "prompt": stream[-n:], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()


@contextlib.contextmanager
def _aggregated(
    model_dir: str, settings: ServerSettings
) -> Iterator[tuple[str, dict[str, tuple[int, dict]]]]:
    """One ``deepinfer serve``; yields its URL and {"both": (its core's pid, its scheduler's cost
    model)}."""
    from deepinfer.bench.serve import launch

    with launch(model_dir, settings.args()) as url:
        yield url, {"both": _core(url)}


def _core(worker_url: str) -> tuple[int, dict]:
    """A server's engine core pid and the cost model its scheduler cuts prompt chunks with (the
    core's start-up calibration, which differs from start to start on a busy host)."""
    import httpx

    health = httpx.get(f"{worker_url}/health", timeout=10).json()
    load = httpx.get(f"{worker_url}/load", timeout=10).json()
    return next(iter(health["engine_cores"].values())), load["cost_model"]


@contextlib.contextmanager
def _disaggregated(
    model_dir: str, settings: ServerSettings, work: Path
) -> Iterator[tuple[str, dict[str, tuple[int, dict]]]]:
    """``deepinfer cluster`` with one prefill and one decode worker (one thread each), every prompt
    through both; yields the router's URL and {role: that worker's (core pid, scheduler cost model)}
    (see :func:`_core`). SIGTERM at the end."""
    import httpx

    from deepinfer.router.cluster import cli_process

    args = ["--model", model_dir, "--prefill", "1", "--decode", "1", "--worker-threads", "1",
            "--min-disaggregated-tokens", "0", "--kv-store-path", str(work / "store"),
            "--worker-kv-cache-gib", str(settings.kv_cache_memory_gib),
            f"--serve-args={' '.join(settings.args(with_cache=False))}", "--log-level", "warning"]  # fmt: skip
    with cli_process(["cluster", *args], work / "cluster.log", "the P/D cluster") as url:
        cores = {status["role"]: _core(worker_url)
                 for worker_url, status in httpx.get(f"{url}/router/workers", timeout=10).json().items()}  # fmt: skip
        if sorted(cores) != ["decode", "prefill"]:
            raise RuntimeError(
                f"the P/D cluster's workers are {sorted(cores)}, not one prefill and one decode"
            )
        yield url, cores


# ---------------------------------------------------------------------------------- the step logs
@dataclass(slots=True)
class CoreLog:
    """One engine core's step log, cut to one trace's time window."""

    adds: dict[str, dict]  # core request id -> {"t", "prompt"}
    steps: list[dict]  # {"t0", "t1", "forward_s", "work", "ids", "first"}, in order
    _starts: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._starts = [s["t0"] for s in self.steps]

    @classmethod
    def read(cls, folder: Path, pid: int, start: float, end: float) -> CoreLog:
        paths = list(folder.glob(f"core-{pid}-*.jsonl"))
        if len(paths) != 1:
            raise RuntimeError(f"expected one step log of core {pid} in {folder}, found {paths}")
        adds, steps = read_step_log(paths[0])
        adds = {rid: a for rid, a in adds.items() if start - 1e-3 <= a["t"] <= end}
        return cls(adds, [s for s in steps if s["t0"] >= start - 1e-3 and s["t0"] <= end])

    def in_send_order(self, served: Served) -> list[str]:
        """The core's ids of the trace's requests, matched to the client's in send order: the core
        takes them in about the order they were sent (two sent close together may swap), so each
        add, in the order taken, goes to the earliest-sent unmatched request of its prompt length."""
        if len(self.adds) != len(served.prompts):
            raise RuntimeError(
                f"the core took {len(self.adds)} requests during a trace of {len(served.prompts)}"
            )
        return _match_adds(self, served, sorted(range(len(served.sends)), key=served.sends.__getitem__))

    def first_step_end(self) -> dict[str, float]:
        """Core request id -> the end of the step that produced its first output token."""
        out = {}
        for s in self.steps:
            for rid in s["first"]:
                out.setdefault(rid, s["t1"])
        return out

    def first_step_start(self) -> dict[str, float]:
        """Core request id -> the start of the first step that computed any of its tokens."""
        out = {}
        for s in self.steps:
            for rid in s["ids"]:
                out.setdefault(rid, s["t0"])
        return out

    def went_straight_on(self, k: int) -> bool:
        """Whether the core started step ``k + 1`` straight after step ``k``: the next step carries on a
        request that step ``k`` ran too. A request that was only added meanwhile proves nothing: on a
        decode worker it waits for its KV to load first, and that wait is no step's time."""
        return k + 1 < len(self.steps) and not set(self.steps[k]["ids"]).isdisjoint(self.steps[k + 1]["ids"])

    def periods(self) -> tuple[list[float], float]:
        """Each step's period and the median loop gap: to the next step's start where the core went
        straight on (``went_straight_on``), else the step's own time plus that median gap (the time
        after it was idle, or waiting for a KV load, which is no step's)."""
        steps = self.steps
        gaps = [steps[k + 1]["t0"] - s["t1"] for k, s in enumerate(steps) if self.went_straight_on(k)]
        gap = statistics.median(gaps) if gaps else 0.0
        return [
            steps[k + 1]["t0"] - s["t0"] if self.went_straight_on(k) else s["t1"] - s["t0"] + gap
            for k, s in enumerate(steps)
        ], gap

    def stepping_at(self, t: float) -> bool:
        """Whether the core was in a step at time ``t``."""
        k = bisect.bisect_right(self._starts, t) - 1
        return k >= 0 and self.steps[k]["t1"] > t

    def idle_at(self, t: float, until: float) -> bool:
        """Whether no step ran at any time in (t, until): none delayed a request sent at ``t`` and
        taken at ``until``."""
        return not any(s["t0"] < until and s["t1"] > t for s in self.steps)


def fit_served_steps(log: CoreLog, peer: CoreLog | None = None) -> tuple[StepCostModel, StepCostModel, dict]:
    """The served step's period and the runner's share, fitted to ``log``'s steps (see the module
    docstring). A step's period runs to the next step's start when the core went straight on (the
    next step carries on a request this one ran: ``CoreLog.went_straight_on``); otherwise, to its own
    end plus the median of those gaps.

    ``peer``: another engine core on the same host (the P/D setup's other worker). A step that starts
    while the peer is in a step shares the host's cores and memory with it; its times are taken to be
    ``1 + contention`` times the uncontended ones, ``contention`` (>= 0) fitted with the models: the
    mean measured over predicted runner time of such steps, over that of the others, minus one.
    Returns (period model, runner model, fit summary with ``contention`` and the jitter: measured
    over predicted runner times, the contention factor included)."""
    steps = log.steps
    if len(steps) < 10:
        raise RuntimeError(f"only {len(steps)} served steps in the calibration trace; too few to fit")
    periods, gap = log.periods()
    works = [[tuple(w) for w in s["work"]] for s in steps]
    shared = np.array([peer is not None and peer.stepping_at(s["t0"]) for s in steps])
    contention = 0.0
    for _ in range(3):  # alternate: the models given the factor, the factor given the models
        scale = 1 + contention * shared
        runner = StepCostModel.fit_mean(
            [(w, s["forward_s"] / f) for w, s, f in zip(works, steps, scale)], "served runner"
        )
        if not shared.any() or shared.all():
            break
        ratio = np.array([s["forward_s"] / runner.predict(w) for w, s in zip(works, steps)])
        contention = max(0.0, float(ratio[shared].mean() / ratio[~shared].mean()) - 1)
    scale = 1 + contention * shared
    period = StepCostModel.fit_mean(
        [(w, p / f) for w, p, f in zip(works, periods, scale)], "served step period"
    )
    jitter = tuple(s["forward_s"] / (runner.predict(w) * f) for w, s, f in zip(works, steps, scale))
    residual = batch_residuals(works, [p / f for p, f in zip(periods, scale)], period)
    summary = {"steps": len(steps), "median_loop_gap_s": gap, "jitter": jitter, "contention": contention,
               "batch_residual_s": residual,
               "steps_sharing_the_host": int(shared.sum()),
               "median_host_s": statistics.median(s["t1"] - s["t0"] - s["forward_s"] for s in steps)}  # fmt: skip
    return period, runner, summary


RESIDUAL_MIN_STEPS = 20  # decode-only steps of one batch size that give it a residual of its own


def batch_residuals(
    works: list[list[tuple[int, int]]], periods: list[float], period: StepCostModel
) -> tuple[float, ...]:
    """``CalibratedCost.batch_residual_s`` from served steps (compositions and measured periods,
    contention taken out): per batch size b (index b - 1), the mean of measured minus ``period``'s
    predicted period over the decode-only steps of b requests. A size seen in fewer than
    ``RESIDUAL_MIN_STEPS`` such steps takes the residual of the size below it (0 below the first)."""
    by_size: dict[int, list[float]] = {}
    for work, seconds in zip(works, periods):
        if work and all(n == 1 for n, _ in work):
            by_size.setdefault(len(work), []).append(float(seconds) - period.predict(work))
    out, last = [], 0.0
    for b in range(1, max(by_size, default=0) + 1):
        if len(by_size.get(b, ())) >= RESIDUAL_MIN_STEPS:
            last = statistics.fmean(by_size[b])
        out.append(last)
    return tuple(out)


def step_errors(log: CoreLog, cost: CalibratedCost) -> dict:
    """How well ``cost``'s models predict ``log``'s own steps: median predicted / measured per step,
    for decode-only steps and steps with a prompt chunk (the period, the simulator's clock
    ``cost.period``, against ``t0`` to the next ``t0`` where the core went straight on; the runner
    fit and the start-up calibration against the runner's time)."""
    runner, startup = cost.runner, cost.model
    out: dict[str, dict] = {}
    for kind, keep in (("decode_only", lambda w: all(n == 1 for n, _ in w)),
                       ("with_prompt", lambda w: any(n > 1 for n, _ in w))):  # fmt: skip
        runner_ratio, startup_ratio, period_ratio = [], [], []
        for k, s in enumerate(log.steps):
            work = [tuple(w) for w in s["work"]]
            if not work or not keep(work):
                continue
            runner_ratio.append(runner.predict(work) / s["forward_s"])
            startup_ratio.append(startup.predict(work) / s["forward_s"])
            nxt = log.steps[k + 1] if k + 1 < len(log.steps) else None
            if log.went_straight_on(k):
                period_ratio.append(cost.period(work) / (nxt["t0"] - s["t0"]))
        out[kind] = {
            "steps": len(runner_ratio),
            "runner_fit_over_measured": _median(runner_ratio),
            "startup_calibration_over_measured_runner": _median(startup_ratio),
            "period_fit_over_measured_period": _median(period_ratio),
            "measured_period_over_runner": _median(
                [
                    (log.steps[k + 1]["t0"] - s["t0"]) / s["forward_s"]
                    for k, s in enumerate(log.steps[:-1])
                    if s["work"] and keep([tuple(w) for w in s["work"]]) and log.went_straight_on(k)
                ]
            ),
        }
    return out


def fit_front(served: Served, first: CoreLog, last: CoreLog) -> dict[str, float]:
    """The front's latency in (client send -> ``first`` core has it, on requests that found that core
    idle) and out (``last`` core's step end -> the client's first token), medians over the trace."""
    ids_in = first.in_send_order(served)
    ins = [first.adds[rid]["t"] - send for rid, send in zip(ids_in, served.sends)
           if first.idle_at(send, first.adds[rid]["t"])]  # fmt: skip
    ends = last.first_step_end()
    ids_out = ids_in if last is first else _decode_ids(served, first, last)
    outs = [send + r.ttft_s - ends[rid] for rid, send, r in zip(ids_out, served.sends, served.results)
            if rid in ends and r.ttft_s is not None]  # fmt: skip
    if not ins or not outs:
        raise RuntimeError("no request of the calibration trace shows the front's latency")
    return {"admission_delay_s": statistics.median(ins), "delivery_delay_s": statistics.median(outs),
            "idle_arrivals": len(ins)}  # fmt: skip


def _decode_ids(served: Served, prefill: CoreLog, decode: CoreLog) -> list[str]:
    """The decode core's ids of the trace's requests in send order: each decode add goes to the
    earliest prefilled, unmatched request with its prompt length."""
    prefill_ids = prefill.in_send_order(served)
    done = prefill.first_step_end()
    return _match_adds(
        decode, served, sorted(range(len(prefill_ids)), key=lambda i: done.get(prefill_ids[i], float("inf")))
    )


def _match_adds(log: CoreLog, served: Served, pending: list[int]) -> list[str]:
    """``log``'s request ids per request of ``served`` (in send order): each add, in the order the
    core took them, goes to the first unmatched request of ``pending`` (the order they should come
    in) with its prompt's length."""
    out = [""] * len(served.prompts)
    pending = list(pending)
    for rid in sorted(log.adds, key=lambda r: log.adds[r]["t"]):
        n = log.adds[rid]["prompt"]
        i = next((i for i in pending if len(served.prompts[i]) == n), None)
        if i is None:
            raise RuntimeError(f"core request {rid} ({n} prompt tokens) matches no request of the trace")
        pending.remove(i)
        out[i] = rid
    return out


def fit_handoff(served: Served, prefill: CoreLog, decode: CoreLog, block_size: int) -> dict[str, float]:
    """The KV handoff, prefill step end -> the decode core's first step with the request, as a
    latency plus a cost per token handed over (the full blocks before the prompt's last token):
    least squares, both terms kept >= 0."""
    prefill_ids, decode_ids = prefill.in_send_order(served), _decode_ids(served, prefill, decode)
    done, started = prefill.first_step_end(), decode.first_step_start()
    rows, ys = [], []
    for i, (p, d) in enumerate(zip(prefill_ids, decode_ids)):
        if p in done and d in started:
            rows.append([1.0, (len(served.prompts[i]) - 1) // block_size * block_size])
            ys.append(started[d] - done[p])
    x, y = np.array(rows), np.array(ys)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if coef[1] < 0:  # no per-token cost seen: a latency alone
        coef = np.array([float(np.mean(y)), 0.0])
    return {"latency_s": max(0.0, float(coef[0])), "per_token_s": float(coef[1]), "handoffs": len(ys),
            "median_s": float(np.median(y))}  # fmt: skip


# ---------------------------------------------------------------------------------- the simulated side
def simulate(
    served: Served, spec: TraceSpec, pools: list[PoolConfig], front: dict, handoff: dict | None,
    kv_bytes_per_token: float,
) -> dict:  # fmt: skip
    """The simulator's figures for ``served``'s trace (its measured send times as arrivals)."""
    t0 = served.start
    arrivals = [
        Arrival(s - t0, f"r{i}", "code", (Segment(("prompt", i), len(p)),), spec.output_len, tuple(p))
        for i, (s, p) in enumerate(zip(served.sends, served.prompts))
    ]
    arrivals.sort(key=lambda a: a.time)
    extra = {}
    if handoff is not None:
        per_token = handoff["per_token_s"]
        extra = {"first_token_from": "decode", "kv_transfer_latency_s": handoff["latency_s"],
                 "kv_bytes_per_token": kv_bytes_per_token,
                 "kv_transfer_bytes_per_s": kv_bytes_per_token / per_token if per_token > 0 else float("inf")}  # fmt: skip
    config = ClusterConfig(
        pools, admission_delay_s=front["admission_delay_s"], delivery_delay_s=front["delivery_delay_s"],
        # Every prompt takes both hops; the aggregated server has no router in front (no prefill queue).
        router=RouterConfig(min_disaggregated_tokens=0, **({} if handoff else {"prefill_queue_limit": 0})),
        **extra,
    )  # fmt: skip
    sim = Simulation(config)
    sim.run(arrivals, until=1e6)
    traces = list(sim.traces.values())
    if any(t.finished_s is None for t in traces):
        raise RuntimeError("the simulation left requests unfinished")
    ttft = [t.first_token_s - t.arrival.time for t in traces]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in traces]
    wall = max(t.finished_s for t in traces)
    out = {f"ttft_{q}": percentile(ttft, int(q[1:])) for q in ("p50", "p90")}
    out |= {f"tpot_{q}": percentile(tpot, int(q[1:])) for q in ("p50", "p90")}
    out["output_tokens_per_s"] = sum(len(t.token_times) for t in traces) / wall
    busy = {role: sum(w.busy_s for w in workers) for role, workers in sim.pools.items()}
    return {"figures": out, "busy_s": busy}


def errors(measured: dict, simulated: dict) -> dict[str, float]:
    out = {k: simulated[k] / measured[k] - 1 for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")}
    out["throughput"] = simulated["output_tokens_per_s"] / measured["output_tokens_per_s"] - 1
    return out


# ---------------------------------------------------------------------------------- the run
def run_validation(
    model_dir: str, calibration: TraceSpec, validation: TraceSpec, settings: ServerSettings,
    setups: tuple[str, ...] = SETUPS, keep: Path | None = None,
) -> dict:  # fmt: skip
    """Both traces through each setup, the fits on the calibration trace, the simulator on both;
    returns the report (see the module docstring). ``keep``: a folder to record the run in (the
    cores' step logs and ``run.json``: what the client saw), which :func:`recheck` fits and
    simulates again without serving."""
    from deepinfer.backends.reference.cache import BLOCK_SIZE

    for setup in setups:
        if setup not in SETUPS:
            raise ValueError(f"setups: {setup!r} is not one of {SETUPS}")
    model = Path(model_dir).name
    traces = {"calibration": calibration, "validation": validation}
    stream, prompts = _prompts(model_dir, traces)
    work = Path(tempfile.mkdtemp(prefix="deepinfer-simval-"))
    # A cache folder of its own, so that the servers calibrate their cost model afresh, sharing the
    # compiled CPU kernels of the usual one (building them takes minutes on a loaded host).
    (work / "cache").mkdir()
    kernels = Path(os.path.expanduser(envs.get("DEEPINFER_CACHE_DIR"))) / "cpu_ops"
    if kernels.is_dir():
        (work / "cache" / "cpu_ops").symlink_to(kernels)
    # One engine thread per core (steadier on a shared host); one start-up calibration for all servers.
    env = {"DEEPINFER_CACHE_DIR": str(work / "cache"), "DEEPINFER_NUM_THREADS": "1",
           "DEEPINFER_STEP_LOG_DIR": str(work / "steps")}  # fmt: skip
    record: dict = {"model_dir": model_dir, "settings": asdict(settings), "BLOCK_SIZE": BLOCK_SIZE,
                    "traces": {n: asdict(t) for n, t in traces.items()}, "setups": {}}  # fmt: skip
    out: dict = {}
    try:
        for setup in setups:
            started = time.perf_counter()
            with _environ(env):
                servers = _aggregated(model_dir, settings) if setup == "aggregated" else _disaggregated(
                    model_dir, settings, work
                )  # fmt: skip
                with servers as (url, cores):
                    _warm(url, model, stream)
                    served = {
                        name: serve_trace(url, model, prompts[name], spec) for name, spec in traces.items()
                    }
            pids = {role: pid for role, (pid, _) in cores.items()}
            startup = {role: StepCostModel(**model) for role, (_, model) in cores.items()}
            record["setups"][setup] = {
                "cores": pids, "startup_cost_models": {role: asdict(m) for role, m in startup.items()},
                "served": {n: {"sends": s.sends, "results": [asdict(r) for r in s.results],
                               "load_average": s.load_average} for n, s in served.items()},
            }  # fmt: skip
            logs = {name: {role: CoreLog.read(work / "steps", pid, s.start, s.end) for role, pid in pids.items()}
                    for name, s in served.items()}  # fmt: skip
            out[setup] = _check_setup(served, logs, traces, startup, _knobs(model_dir, settings),
                                      _kv_bytes_per_token(model_dir), BLOCK_SIZE)  # fmt: skip
            out[setup]["wall_s"] = time.perf_counter() - started
    finally:
        if keep is not None and (work / "steps").is_dir():
            shutil.copytree(work / "steps", keep / "steps", dirs_exist_ok=True)
            (keep / "run.json").write_text(json.dumps(record))
        shutil.rmtree(work, ignore_errors=True)
    return {"settings": settings.args(), "server_env": {"DEEPINFER_NUM_THREADS": "1"},
            "num_blocks": _knobs(model_dir, settings).num_blocks, **out}  # fmt: skip


def recheck(folder: Path) -> dict:
    """The report of a run recorded by :func:`run_validation` (``keep=folder``), fitted and
    simulated again from its step logs and client results: no server runs."""
    from deepinfer.bench.serve import RequestResult

    record = json.loads((folder / "run.json").read_text())
    model_dir, settings = record["model_dir"], ServerSettings(**record["settings"])
    traces = {
        n: TraceSpec(**{**t, "suffix_len": tuple(t["suffix_len"])}) for n, t in record["traces"].items()
    }
    _, prompts = _prompts(model_dir, traces)
    out: dict = {}
    for setup, r in record["setups"].items():
        served = {
            n: Served(prompts[n], s["sends"], [RequestResult(**x) for x in s["results"]], s["load_average"])
            for n, s in r["served"].items()
        }  # fmt: skip
        logs = {name: {role: CoreLog.read(folder / "steps", pid, s.start, s.end) for role, pid in r["cores"].items()}
                for name, s in served.items()}  # fmt: skip
        startup = {role: StepCostModel(**m) for role, m in r["startup_cost_models"].items()}
        out[setup] = _check_setup(served, logs, traces, startup, _knobs(model_dir, settings),
                                  _kv_bytes_per_token(model_dir), record["BLOCK_SIZE"])  # fmt: skip
    return {"settings": settings.args(), "server_env": {"DEEPINFER_NUM_THREADS": "1"},
            "num_blocks": _knobs(model_dir, settings).num_blocks, **out}  # fmt: skip


def _prompts(model_dir: str, traces: dict[str, TraceSpec]) -> tuple[list[int], dict[str, list[list[int]]]]:
    """The held-out token stream and each trace's prompts."""
    from deepinfer.bench.workload import heldout_stream
    from deepinfer.tokenizer import Tokenizer

    stream = heldout_stream(Tokenizer(Path(model_dir)))
    return stream, {name: build_prompts(stream, spec) for name, spec in traces.items()}


def _kv_bytes_per_token(model_dir: str) -> int:
    """The reference backend's KV cache bytes per token (float32 latent + rope rows, every layer)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)  # MTP layers cache too
    return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4 * layers


def _knobs(model_dir: str, settings: ServerSettings) -> EngineKnobs:
    """The simulated engine's settings: the servers' (``settings``) and their KV cache's size."""
    from deepinfer.backends.reference.cache import BLOCK_SIZE

    num_blocks = int(settings.kv_cache_memory_gib * (1 << 30)) // (
        BLOCK_SIZE * _kv_bytes_per_token(model_dir)
    )
    return EngineKnobs(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        step_time_budget_s=settings.step_time_budget_ms / 1e3, max_model_len=1 << 20,
    )  # fmt: skip


def _check_setup(
    served: dict[str, Served], logs: dict[str, dict[str, CoreLog]], traces: dict[str, TraceSpec],
    startup: dict[str, StepCostModel], knobs: EngineKnobs, kv_bytes_per_token: float, block_size: int,
) -> dict:  # fmt: skip
    """Fit on the calibration trace, simulate both traces, compare (``startup``: each role's
    scheduler cost model, the one its server's engine cut prompt chunks with)."""
    cal, cal_logs = served["calibration"], logs["calibration"]
    roles = list(cal_logs)
    # The P/D setup's two workers share this host: each one's peer is the other.
    peers = {"prefill": "decode", "decode": "prefill"}
    fits = {role: fit_served_steps(cal_logs[role], cal_logs.get(peers.get(role, ""))) for role in roles}
    first, last = (cal_logs["both"],) * 2 if roles == ["both"] else (cal_logs["prefill"], cal_logs["decode"])
    front = fit_front(cal, first, last)
    handoff = (
        fit_handoff(cal, cal_logs["prefill"], cal_logs["decode"], block_size) if "prefill" in roles else None
    )
    pools = [
        PoolConfig(
            role,
            1,
            1,
            CalibratedCost(startup[role], p, r, summary.pop("jitter"), summary["batch_residual_s"]),
            knobs,
            host_contention=summary["contention"],
        )
        for role, (p, r, summary) in fits.items()
    ]
    result: dict = {
        "startup_cost_models": {role: asdict(m) for role, m in startup.items()},
        "fitted_on_calibration": {
            "front": front,
            "handoff": handoff,
            **{
                f"{role}_step": {"period": asdict(p), "runner": asdict(r), **summary}
                for role, (p, r, summary) in fits.items()
            },
        },
    }
    for name, s in served.items():
        measured = s.figures()
        simulated = simulate(s, traces[name], pools, front, handoff, kv_bytes_per_token)
        busy = {role: sum(log.periods()[0]) for role, log in logs[name].items()}
        result[name] = {
            "trace": asdict(traces[name]),
            "load_average_before_after": s.load_average,
            "engine_busy_s": {"measured_period": busy, "simulated_period": simulated["busy_s"]},
            "step_model_check": {pool.role: step_errors(logs[name][pool.role], pool.cost) for pool in pools},
            "measured": measured,
            "simulated": simulated["figures"],
            "errors": errors(measured, simulated["figures"]),
        }
    return result


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for child processes started inside, and restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _figures(result: dict) -> dict:
    figures = {f"{m.removesuffix('_s')}_{q}": result[m][q] for m, q in METRICS}
    figures["output_tokens_per_s"] = result["output_tokens_per_s"]
    return figures
