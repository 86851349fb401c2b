"""The day-level cache stage: a workload's requests through the KV tiers only (no scheduler).

Fast enough to cover a day or more, which is what TTLs and session re-visits after hours need; the
cache hit rate comes out of it (prefix structure x retention x capacity), it is never an input.
A ``share`` of the sessions runs against tiers whose capacities the caller scaled by the same share;
per-day figures are scaled back up.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from deepinfer.sim.tiers import TieredStore
from deepinfer.sim.workload import WorkloadSpec, arrivals


@dataclass(slots=True)
class CacheStage:
    hit_rate: dict[str, float]  # tier -> share of prompt tokens it supplied
    hourly_hit_rate: list[float]  # all tiers, per simulated hour
    occupancy_tb: list[tuple[float, dict[str, float]]]  # (seconds, tier -> TB), cluster scale
    input_tokens_per_day: float
    cached_tokens_per_day: float
    mean_prompt_tokens: float
    mean_output_tokens: float

    @property
    def total_hit_rate(self) -> float:
        return sum(self.hit_rate.values())


def run_cache_stage(
    spec: WorkloadSpec,
    store: TieredStore,
    horizon_s: float,
    share: float = 1.0,
    seed: int = 0,
    samples: int = 48,
) -> CacheStage:
    """Replay ``horizon_s`` of ``spec`` (``share`` of its sessions) through ``store``; each request
    looks up its prompt, then writes its KV through (as it would on finishing). The trace starts in
    the sessions' steady state (``arrivals(..., steady_state=True)``): the turns before 0 of the
    sessions then in progress only fill the store, so later turns come back from the first hour."""
    hours = math.ceil(horizon_s / 3600)
    prompt = [0] * hours
    hit = [0] * hours
    by_tier: dict[str, int] = {t.name: 0 for t in store.tiers}
    occupancy = []
    outputs = []
    next_sample = 0.0
    for arrival in arrivals(spec, horizon_s, seed, share, steady_state=True):
        found = store.lookup(arrival, 0, arrival.time)
        if arrival.time < 0:  # the last turn of a session in progress at the start: cached, not counted
            store.write(arrival, arrival.time)
            continue
        h = int(arrival.time // 3600)
        prompt[h] += arrival.prompt_tokens
        hit[h] += sum(found.tokens.values())
        for name, n in found.tokens.items():
            by_tier[name] += n
        store.write(arrival, arrival.time)
        outputs.append(arrival.output_tokens)
        if arrival.time >= next_sample:
            occupancy.append(
                (arrival.time, {k: v / share / 1e12 for k, v in store.occupancy(arrival.time).items()})
            )
            next_sample += horizon_s / samples
    total = sum(prompt)
    if not total:
        raise ValueError(
            "the workload produced no requests in the cache horizon; raise the rates or the horizon"
        )
    # Leave out the first hour (the cache starts empty) from the per-day figures.
    steady = slice(1, None) if hours > 1 else slice(None)
    day = 86400 / (horizon_s - (3600 if hours > 1 else 0)) / share
    return CacheStage(
        hit_rate={k: v / total for k, v in by_tier.items()},
        hourly_hit_rate=[hit[i] / prompt[i] if prompt[i] else float("nan") for i in range(hours)],
        occupancy_tb=occupancy,
        input_tokens_per_day=sum(prompt[steady]) * day,
        cached_tokens_per_day=sum(hit[steady]) * day,
        mean_prompt_tokens=total / len(outputs),
        mean_output_tokens=statistics.fmean(outputs),
    )
