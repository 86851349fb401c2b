"""Retention by traffic class and capacity eviction, with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.kvstore.keys import StoreNamespace, store_key
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.record import HEADER_SIZE
from deepinfer.kvstore.retention import (
    DEFAULT_TTLS,
    Entry,
    RetentionPolicy,
    expired,
    parse_duration,
    parse_ttls,
    plan_eviction,
)
from deepinfer.kvstore.store import DirSpec, KVStore

DAY = 86400.0
NS = StoreNamespace("weights", "tok", "layout", 16, "float32", (0, 1), "full")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [store_key(NS.digest(), bytes([tag, i % 256, i // 256]) * 5 + b"x") for i in range(n)]


def save_all(store: KVStore, ks: list[bytes], cls: str) -> None:
    for i, key in enumerate(ks):
        slot = store.reserve()
        assert slot is not None
        store.slot(slot).fill_(i % 251)
        store.commit(key, slot, cls)
    assert store.flush(10)


def test_parsing_and_the_policy_rules() -> None:
    assert parse_ttls("agent=3d,chat=7d") == DEFAULT_TTLS
    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200 and parse_duration("15") == 15
    for bad in ("agent", "agent=0d", "agent=3x", "Agent=3d", "a=1d,a=2d", ""):
        with pytest.raises(ValueError):
            parse_ttls(bad)
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    assert policy.check_class(None) == "chat"
    with pytest.raises(ValueError, match="traffic_class 'batch' is unknown"):
        policy.check_class("batch")
    # A block shared by classes keeps the longest TTL: an agent hit never shortens a chat expiry.
    e = policy.expiry(None, 0.0, "chat")
    assert policy.expiry(e, 1.0, "agent") == e == 7 * DAY
    assert policy.expiry(policy.expiry(None, 0.0, "agent"), 1.0, "chat") == 1.0 + 7 * DAY


def test_eviction_takes_expired_first_then_least_recently_used_and_skips_leases() -> None:
    entries = [
        Entry(b"old-live", 10, last_used=1.0, expires_at=100.0),
        Entry(b"expired", 10, last_used=50.0, expires_at=5.0),
        Entry(b"leased", 10, last_used=0.0, expires_at=100.0, leased=True),
        Entry(b"new-live", 10, last_used=9.0, expires_at=100.0),
    ]
    assert expired(entries, now=10.0) == [b"expired"]
    victims, fits = plan_eviction(entries, now=10.0, capacity=40, incoming=10)
    assert victims == [b"expired", b"old-live"] and fits
    victims, fits = plan_eviction(entries, now=10.0, capacity=100, incoming=10)
    assert victims == [] and fits  # under the high watermark: nothing goes
    all_leased = [Entry(b"a", 10, 0.0, 100.0, leased=True)]
    assert plan_eviction(all_leased, 10.0, capacity=10, incoming=5) == ([], False)  # fails closed


@pytest.mark.parametrize("cls", ["agent", "chat"])
def test_expired_entries_of_each_class_are_not_served_and_are_collected(tmp_path: Path, cls: str) -> None:
    clock = Clock()
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    store = KVStore(NS, 256, 64, policy, disk=DirSpec(tmp_path, 1 << 20), clock=clock)
    ks = keys(8)
    save_all(store, ks, cls)
    ttl = DEFAULT_TTLS[cls]
    clock.now += ttl - 1
    assert store.lookup(ks) == 8
    clock.now += 2  # past the TTL: neither host memory nor disk serves it
    assert store.lookup(ks) == 0
    assert store.load(ks, cls).wait(5) == 0
    store.collect()
    assert not list(store.files[0].dir.rglob("*.kvb"))
    tiers = store.snapshot()["tiers"]
    assert tiers["disk"]["expirations"] == 8 and tiers["disk"]["entries"] == 0
    assert tiers["host"]["expirations"] == 8 and tiers["host"]["entries"] == 0
    store.close()
    # A restarted store does not resurrect them either.
    again = KVStore(NS, 256, 64, policy, disk=DirSpec(tmp_path, 1 << 20), clock=clock)
    assert again.lookup(ks) == 0
    again.close()


def test_a_hit_by_the_longer_class_keeps_a_block_alive(tmp_path: Path) -> None:
    clock = Clock()
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    store = KVStore(NS, 256, 64, policy, disk=DirSpec(tmp_path, 1 << 20), clock=clock)
    ks = keys(4)
    save_all(store, ks, "agent")
    clock.now += 2 * DAY
    assert store.load(ks, "chat").wait(5) == 4  # a chat hit: expiry is now +7 days from here
    clock.now += 5 * DAY
    assert store.lookup(ks) == 4
    store.close()
    restarted = KVStore(NS, 256, 64, policy, disk=DirSpec(tmp_path, 1 << 20), clock=clock)
    assert restarted.lookup(ks) == 4  # the extension is on disk (file mtime), not only in memory
    restarted.close()


def test_capacity_eviction_keeps_each_tier_under_its_cap(tmp_path: Path) -> None:
    clock = Clock()
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    slot_bytes, host_slots = 1024, 16
    cap = 40 * (slot_bytes + HEADER_SIZE)
    store = KVStore(
        NS,
        slot_bytes,
        host_slots,
        policy,
        disk=DirSpec(tmp_path / "d", cap),
        shared=DirSpec(tmp_path / "s", cap),
        clock=clock,
    )
    ks = keys(200)
    for chunk in range(0, 200, 10):
        clock.now += 1
        save_all(store, ks[chunk : chunk + 10], "chat")
        tiers = store.snapshot()["tiers"]
        assert tiers["host"]["entries"] <= host_slots
        for name in ("disk", "shared"):
            on_disk = sum(p.stat().st_size for p in (tmp_path / name[0]).rglob("*.kvb"))
            assert on_disk <= cap and tiers[name]["bytes"] <= cap
    tiers = store.snapshot()["tiers"]
    assert tiers["disk"]["evictions"] > 100 and tiers["host"]["evictions"] > 100
    # Least recently used went first: the newest blocks are still there, the oldest are not.
    assert store.lookup(ks[-20:]) == 20 and store.lookup(ks[:1]) == 0
    store.close()


def test_holds_keep_entries_from_eviction_until_released_or_expired(tmp_path: Path) -> None:
    clock = Clock()
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    store = KVStore(NS, 128, 8, policy, clock=clock)
    ks = keys(40)
    save_all(store, ks[:4], "chat")
    store.hold(ks[:4], seconds=30)
    for key in ks[4:20]:  # twice the free slots: everything unheld gets evicted, the held four stay
        clock.now += 0.1
        save_all(store, [key], "chat")
    assert store.lookup(ks[:4]) == 4
    clock.now += 31
    store.collect()  # the hold expired: its entries are ordinary LRU entries again
    for key in ks[20:40]:
        clock.now += 0.1
        save_all(store, [key], "chat")
    assert store.lookup(ks[:1]) == 0
    store.close()


def test_disk_touches_persist_in_packs_and_only_the_newest_is_kept(tmp_path: Path) -> None:
    clock = Clock()
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    tier = PackTier("disk", tmp_path, NS.digest(), NS.describe(), 1 << 30, policy, TierCounters(), clock)
    ks = keys(3)
    tier.write_batch([(k, bytes([i]) * 100, "agent") for i, k in enumerate(ks)], clock.now)
    for _ in range(5):  # hits by chat, each written with the next batch
        clock.now += DAY
        tier.touch(ks[0], clock.now, "chat")
        tier.write_batch([], clock.now)
    assert len(list(tmp_path.rglob("*.kvp"))) == 2  # the data pack and the newest touch, not one per touch
    clock.now += 4 * DAY  # 9 days in: the agent blocks expired, the chat-touched one lives to day 12
    restarted = PackTier("disk", tmp_path, NS.digest(), NS.describe(), 1 << 30, policy, TierCounters(), clock)
    assert [restarted.contains(k, clock.now) for k in ks] == [True, False, False]
    assert bytes(restarted.read(ks[0], clock.now)) == bytes([0]) * 100
    clock.now += 3 * DAY
    assert restarted.collect(clock.now) == 1 and not list(tmp_path.rglob("*.kvp"))  # both packs went
