"""The host tier's slot pool: a reservation evicts what is evictable; reserved and leased slots are
never victims (issue 34, defect 15)."""

from __future__ import annotations

from deepinfer.kvstore.host_tier import HostTier
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.retention import DEFAULT_TTLS, Entry, RetentionPolicy, plan_eviction

POLICY = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
NOW = 1_000_000.0


def tier(slots: int) -> HostTier:
    return HostTier(slots, 16, False, POLICY, TierCounters(), lambda: NOW)


def fill(t: HostTier, n: int, start: float = NOW) -> list[bytes]:
    """``n`` committed, unleased entries, used in order (the first least recently)."""
    keys = [b"key-%03d" % i for i in range(n)]
    for i, key in enumerate(keys):
        slot = t.reserve(start + i)
        assert slot is not None
        assert t.commit(key, slot, start + i, "chat")
        t.release(slot)
    return keys


def test_a_reservation_evicts_committed_entries_while_other_slots_are_reserved() -> None:
    t = tier(10)
    keys = fill(t, 5)
    reserved = [t.reserve(NOW + 10) for _ in range(5)]  # in flight: copies into these run
    assert None not in reserved and not t.free
    slot = t.reserve(NOW + 20)  # before the fix: refused (the 5 reservations were not counted)
    assert slot is not None and slot not in reserved
    assert t.counters.evictions >= 1
    gone = [k for k in keys if k not in t.slot_of]
    assert gone == keys[: len(gone)]  # least recently used first
    assert all(t.leases.get(s) == 1 for s in reserved)  # reservations are never victims
    assert len(t.slot_of) + len(reserved) + 1 + len(t.free) == t.num_slots


def test_leased_entries_are_never_victims_and_a_pool_of_leases_refuses() -> None:
    t = tier(4)
    keys = fill(t, 2)
    leased = t.slot_of[keys[0]]
    t.lease(leased)  # being loaded: not evictable
    reserved = [t.reserve(NOW + 10) for _ in range(2)]
    assert None not in reserved
    slot = t.reserve(NOW + 20)
    assert slot is not None and keys[0] in t.slot_of and keys[1] not in t.slot_of
    assert t.reserve(NOW + 30) is None  # every slot leased or reserved: refused, fails closed


def test_reservations_above_the_low_watermark_evict_only_what_the_new_slot_needs() -> None:
    t = tier(20)
    keys = fill(t, 3)
    for _ in range(17):
        assert t.reserve(NOW + 10) is not None
    assert t.reserve(NOW + 20) is not None
    assert [k in t.slot_of for k in keys] == [False, True, True]  # one evicted, not all three


def test_plan_eviction_with_leases_above_the_low_watermark_frees_just_enough() -> None:
    entries = [Entry(b"leased", 90, 0.0, 1e9, leased=True)] + [
        Entry(b"e%d" % i, 1, float(i), 1e9) for i in range(9)
    ]
    victims, fits = plan_eviction(entries, now=10.0, capacity=100, incoming=2)
    assert victims == [b"e0"] and fits  # 101 -> 100; the low watermark (85) is out of reach
