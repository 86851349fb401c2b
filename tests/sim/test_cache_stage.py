"""The cache hit rate emerges from prefix structure, TTLs and capacity: sessions that come back after
hours hit less as the TTL or the store shrinks."""

import math

import pytest

from deepinfer.sim.cachesim import run_cache_stage
from deepinfer.sim.policies import TierRetention, retention_policy
from deepinfer.sim.tiers import Tier, TieredStore
from deepinfer.sim.workload import LengthDist, TrafficClass, WorkloadSpec

KV = 70272.0


def revisiting(ttl_s: float) -> WorkloadSpec:
    return WorkloadSpec(
        classes=[
            TrafficClass(
                name="chat", rate_per_s=0.25, system_prompts=3, system_prompt_tokens=LengthDist(mean=500),
                turns_per_session=6, revisit_gap_s=LengthDist(kind="exponential", mean=2 * 3600),
                input_tokens=LengthDist(kind="uniform", low=100, high=400), output_tokens=LengthDist(mean=300),
                ttl_s=ttl_s,
            )
        ]
    )  # fmt: skip


def hit_rate(ttl_s: float, capacity_bytes: float) -> float:
    spec = revisiting(ttl_s)
    store = TieredStore([Tier("store", TierRetention(retention_policy(spec.ttls), capacity_bytes), 50e9)], KV)
    return run_cache_stage(spec, store, 8 * 3600, seed=3).total_hit_rate


def test_hit_rate_falls_as_the_ttl_shrinks() -> None:
    rates = [hit_rate(ttl, math.inf) for ttl in (7 * 86400, 3 * 3600, 1800, 300)]
    assert rates == sorted(rates, reverse=True)
    assert rates[0] > 0.7  # long sessions re-read their history
    assert rates[0] - rates[-1] > 0.3  # hours-later revisits miss once the TTL is minutes
    assert rates[-1] > 0.0  # the shared system prompts still hit


def test_hit_rate_falls_as_capacity_shrinks() -> None:
    rates = [hit_rate(7 * 86400, capacity) for capacity in (math.inf, 100e9, 30e9, 5e9)]
    assert rates == sorted(rates, reverse=True)
    assert rates[0] - rates[-1] > 0.3


def test_occupancy_is_bounded_by_capacity_and_reported_over_time() -> None:
    capacity = 5e11
    spec = revisiting(7 * 86400)
    store = TieredStore([Tier("store", TierRetention(retention_policy(spec.ttls), capacity), 50e9)], KV)
    stage = run_cache_stage(spec, store, 6 * 3600, seed=1)
    assert len(stage.occupancy_tb) > 10
    assert max(o["store"] for _, o in stage.occupancy_tb) <= capacity / 1e12
    assert stage.occupancy_tb[-1][1]["store"] > stage.occupancy_tb[1][1]["store"] * 0.5


def test_a_workload_without_requests_is_an_error() -> None:
    store = TieredStore([Tier("store", TierRetention(retention_policy({"chat": 3600}), 1e12), 50e9)], KV)
    spec = revisiting(3600).model_copy(
        update={"classes": [revisiting(3600).classes[0].model_copy(update={"rate_per_s": 1e-9})]}
    )
    with pytest.raises(ValueError, match="no requests"):
        run_cache_stage(spec, store, 60)
