"""The stand-in policies behind the simulator's seams."""

import math

import pytest

from deepinfer.sim.policies import (
    ActiveLoadRouter,
    PredictedTimeRouter,
    RankLoad,
    TtlLruRetention,
    expert_imbalance,
    identity_placement,
    synthetic_expert_load,
)


def test_ttl_expires_and_use_refreshes() -> None:
    r = TtlLruRetention(math.inf)
    r.touch("a", 10, ttl_s=100, now=0)
    r.touch("b", 10, ttl_s=100, now=0)
    assert r.contains("a", 50)
    r.touch("a", 10, ttl_s=100, now=90)  # a hit writes again: refreshed
    assert r.contains("a", 150) and not r.contains("b", 150)
    assert r.used_bytes(150) == 10 and r.expired_bytes == 10
    assert not r.contains("a", 191)


def test_capacity_evicts_the_least_recently_used() -> None:
    r = TtlLruRetention(30)
    for key in "abc":
        r.touch(key, 10, ttl_s=1e9, now=0)
    assert r.contains("a", 1)  # a is now the most recently used
    r.touch("d", 10, ttl_s=1e9, now=2)
    assert not r.contains("b", 3) and r.contains("a", 3) and r.contains("d", 3)
    assert r.used_bytes(3) == 30 and r.evicted_bytes == 10
    r.touch("huge", 31, ttl_s=1e9, now=4)  # larger than the tier: not kept, nothing evicted for it
    assert not r.contains("huge", 5) and r.used_bytes(5) == 30
    with pytest.raises(ValueError, match="capacity_bytes"):
        TtlLruRetention(-1)


def test_routers() -> None:
    loads = [RankLoad(0, 0.5, 3, 1000), RankLoad(1, 0.1, 9, 90000), RankLoad(2, 0.1, 1, 100)]
    assert PredictedTimeRouter().pick(100, loads) == 1  # least predicted time, lowest id on ties
    assert ActiveLoadRouter(tokens_per_request=1000).pick(100, loads) == 2


def test_identity_placement_and_imbalance() -> None:
    load = synthetic_expert_load(4, 16, sigma=0.0)
    assert expert_imbalance(identity_placement, load, 16, 4, 1, 4) == pytest.approx(1.0)
    skewed = synthetic_expert_load(4, 16, sigma=1.0, seed=1)
    assert expert_imbalance(identity_placement, skewed, 16, 4, 1, 16) > expert_imbalance(
        identity_placement, skewed, 16, 4, 1, 2
    )  # finer sharding, worse balance
    with pytest.raises(ValueError, match="no redundant experts"):
        identity_placement(skewed, 20, 4, 1, 4)
