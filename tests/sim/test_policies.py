"""The KV store's retention policy as the simulator drives it, and the expert placement seam."""

import math

import pytest

from deepinfer.sim.policies import (
    TierRetention,
    expert_imbalance,
    identity_placement,
    retention_policy,
    synthetic_expert_load,
)


def test_the_stores_ttls_by_class_extend_and_never_shorten() -> None:
    r = TierRetention(retention_policy({"agent": 100.0, "chat": 1000.0}), math.inf)
    r.save("a", 10, "agent", now=0)
    r.save("b", 10, "chat", now=0)
    assert r.contains("a", "chat", 50)  # a chat hit extends the agent entry to 50 + 1000
    assert r.contains("a", "agent", 500)  # an agent hit keeps 1050 (600 would shorten it)
    assert r.contains("b", "agent", 10)  # nor does an agent hit shorten the chat entry (1000)
    assert r.contains("b", "agent", 200)  # held past the agent TTL
    assert r.used_bytes(1020) == 10 and r.expired_bytes == 10  # b collected at 1000, a held
    assert not r.contains("a", "agent", 1060) and r.used_bytes(1060) == 0


def test_capacity_evicts_expired_then_least_recently_used_down_to_the_low_watermark() -> None:
    r = TierRetention(retention_policy({"chat": 1e9, "short": 10.0}), 100)
    r.save("old", 10, "short", now=0)  # expires at 10
    for i in range(8):
        r.save(f"k{i}", 10, "chat", now=1 + i)
    assert r.used_bytes(9) == 90 and r.evicted_bytes == 0  # 90 <= 95: under the high watermark
    assert r.contains("k0", "chat", 9.5)  # k0 is now the most recently used
    r.save("new", 10, "chat", now=11)  # 100 > 95: evict to at most 85 with the new one
    assert not r.contains("old", "chat", 12) and r.expired_bytes == 10  # the expired entry first
    assert not r.contains("k1", "chat", 12) and r.contains("k0", "chat", 12)  # then LRU
    assert r.used_bytes(12) == 80 and r.evicted_bytes == 10
    r.save("huge", 101, "chat", now=13)  # larger than the tier: refused (fails closed)
    assert not r.contains("huge", "chat", 14) and r.refused_bytes == 101
    with pytest.raises(ValueError, match="capacity_bytes"):
        TierRetention(retention_policy({"chat": 1.0}), -1)
    with pytest.raises(ValueError, match="at least one traffic class"):
        retention_policy({})


def test_identity_placement_and_imbalance() -> None:
    load = synthetic_expert_load(4, 16, sigma=0.0)
    assert expert_imbalance(identity_placement, load, 16, 4, 1, 4) == pytest.approx(1.0)
    skewed = synthetic_expert_load(4, 16, sigma=1.0, seed=1)
    assert expert_imbalance(identity_placement, skewed, 16, 4, 1, 16) > expert_imbalance(
        identity_placement, skewed, 16, 4, 1, 2
    )  # finer sharding, worse balance
    with pytest.raises(ValueError, match="no redundant experts"):
        identity_placement(skewed, 20, 4, 1, 4)
