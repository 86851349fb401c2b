"""What a simulation run measured: latency percentiles, throughput, balance, cache hits, occupancy.

Created by :func:`summarise` from a finished :class:`~deepinfer.sim.cluster.Simulation`; plain data
(JSON-ready). Latencies are those of the requests that arrived in [``warmup_s``, ``end_s``) and
finished before the run stopped (run it past ``end_s`` so that they can; the share that did not is
reported); throughput counts every token emitted in [``warmup_s``, ``end_s``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from deepinfer.sim.cluster import Simulation


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        **{f"p{q}": percentile(values, q) for q in (50, 90, 99)},
    }


def summarise(sim: Simulation, warmup_s: float, end_s: float, chips: float) -> dict:
    """``chips``: the accelerators the simulated ranks stand for (throughput per chip divides by it)."""
    window = end_s - warmup_s
    if window <= 0:
        raise ValueError(f"the measurement window is empty (warm-up {warmup_s} s, end {end_s} s)")
    measured = [t for t in sim.traces.values() if warmup_s <= t.arrival.time < end_s]
    done = [t for t in measured if t.finished_s is not None]
    ttft = [t.first_token_s - t.arrival.time for t in done]
    tpot = [
        (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
        for t in done
        if len(t.token_times) > 1
    ]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    out_tokens = sum(1 for t in sim.traces.values() for x in t.token_times if warmup_s <= x < end_s)
    prompt_tokens = sum(t.arrival.prompt_tokens for t in done)
    hits: dict[str, int] = {}
    for t in done:
        for tier, n in t.hit_tokens.items():
            hits[tier] = hits.get(tier, 0) + n
    balance = {
        role: statistics.fmean(w.balance_sum / w.steps for w in workers if w.steps)
        if any(w.steps for w in workers)
        else 1.0
        for role, workers in sim.pools.items()
    }
    return {
        "requests_finished": len(done),
        "requests_arrived": len(measured),
        "requests_rejected": sum(t.rejected for t in measured),
        "window_s": window,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(tpot),
        "itl_s": _stats(itl),
        "output_tokens_per_s": out_tokens / window,
        "output_tokens_per_s_per_chip": out_tokens / window / chips,
        "tokens_per_s_per_user": 1 / statistics.fmean(tpot) if tpot else float("nan"),
        "balance": balance,
        "prompt_tokens": prompt_tokens,
        "cache_hit_rate": {tier: n / prompt_tokens for tier, n in hits.items()} if prompt_tokens else {},
        "preemptions": sum(
            r.scheduler.num_preemptions for ws in sim.pools.values() for w in ws for r in w.ranks
        ),
        "occupancy_bytes": [(t, occ) for t, occ in sim.occupancy],
    }
