"""The host-memory tier: a fixed pool of block slots (pinned on devices), least recently used first.

One ``uint8`` tensor ``[num_slots, slot_bytes]`` allocated once (``pin_memory`` when the engine runs
on an accelerator, so device<->host copies are DMA). A slot is *reserved* (leased, invisible to
lookups) while a device block or a file is copied into it, *committed* when its bytes are complete,
and *leased* again while a load copies it out or the write-behind thread writes it to disk. Leased
and reserved slots are never evicted; committed unleased ones are, by the retention policy, which
counts the reservations as occupied. A new reservation is refused only when every slot is leased or
reserved. Thread safety: the owning ``KVStore`` serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.retention import Entry, RetentionPolicy, expired, is_expired, plan_eviction


class HostTier:
    name = "host"

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        pin_memory: bool,
        policy: RetentionPolicy,
        counters: TierCounters,
        clock: Callable[[], float],
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.data = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.policy = policy
        self.counters = counters
        self.clock = clock
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # committed entries, LRU first
        self.meta: dict[bytes, Entry] = {}
        self.leases: dict[int, int] = {}  # slot -> lease count (reserved slots included)
        self.key_of: dict[int, bytes] = {}  # committed slot -> key
        self.classes: dict[bytes, str] = {}  # longest-lived class seen per entry (for write-behind)

    def get(self, key: bytes, now: float) -> int | None:
        """The committed, unexpired slot of ``key`` (expired entries are dropped here)."""
        slot = self.slot_of.get(key)
        if slot is None:
            return None
        if is_expired(self.meta[key], now) and not self.leases.get(slot):
            self._remove(key)
            self.counters.expirations += 1
            return None
        return slot

    def touch(self, key: bytes, now: float, cls: str) -> None:
        entry = self.meta[key]
        entry.last_used = now
        entry.expires_at = self.policy.expiry(entry.expires_at, now, cls)
        if self.policy.ttls[cls] > self.policy.ttls[self.classes[key]]:
            self.classes[key] = cls
        self.slot_of.move_to_end(key)

    def lease(self, slot: int) -> None:
        self.leases[slot] = self.leases.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        left = self.leases[slot] - 1
        if left:
            self.leases[slot] = left
        else:
            del self.leases[slot]
            if slot not in self.key_of:
                self.free.append(slot)  # a reservation abandoned before commit

    def reserve(self, now: float) -> int | None:
        """A leased, uncommitted slot to fill, evicting per the retention policy; None if all are leased."""
        if not self.free:
            entries = [
                Entry(k, 1, e.last_used, e.expires_at, bool(self.leases.get(self.slot_of[k])))
                for k, e in self.meta.items()
            ]
            # The pool also holds reservations not yet committed (no entries, leased): they and the
            # new slot come on top of the committed entries, so evictable entries make room.
            reserved = self.num_slots - len(self.slot_of)
            victims, _ = plan_eviction(entries, now, self.num_slots, incoming=reserved + 1)
            for key in victims:
                if is_expired(self.meta[key], now):
                    self.counters.expirations += 1
                else:
                    self.counters.evictions += 1
                self._remove(key)
            if not self.free:
                return None
        slot = self.free.pop()
        self.lease(slot)
        return slot

    def commit(self, key: bytes, slot: int, now: float, cls: str) -> bool:
        """Publish a filled reservation under ``key`` (keeps the caller's lease). False when ``key``
        was committed meanwhile by someone else: the caller releases its slot."""
        if key in self.slot_of:
            return False
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.meta[key] = Entry(key, 1, now, self.policy.expiry(None, now, cls))
        self.classes[key] = cls
        self.counters.bytes_written += self.slot_bytes
        self.counters.writes += 1
        self._gauges()
        return True

    def collect(self, now: float) -> int:
        entries = [
            Entry(k, 1, e.last_used, e.expires_at, bool(self.leases.get(self.slot_of[k])))
            for k, e in self.meta.items()
        ]
        keys = expired(entries, now)
        for key in keys:
            self._remove(key)
        self.counters.expirations += len(keys)
        return len(keys)

    def _remove(self, key: bytes) -> None:
        slot = self.slot_of.pop(key)
        del self.key_of[slot]
        del self.meta[key]
        del self.classes[key]
        if not self.leases.get(slot):
            self.free.append(slot)
        self._gauges()

    def _gauges(self) -> None:
        self.counters.entries = len(self.slot_of)
        self.counters.bytes = len(self.slot_of) * self.slot_bytes
