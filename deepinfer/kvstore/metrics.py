"""Counters of one store, as plain data (the server's /metrics turns them into Prometheus series).

Updated by the tiers and the store under the store's lock; ``snapshot`` returns a JSON-ready dict:
``{"tiers": {tier: {hits, bytes_read, bytes_written, writes, evictions, expirations, corrupt_reads,
entries, bytes, read_errors, write_errors}}, "lookups", "lookup_blocks", "hit_blocks", "misses", "load_latency": {"buckets":
[upper bounds in s], "counts": [per bucket, cumulative], "sum", "count"}, "saves_refused", "writes_dropped",
"load_errors", "writer_errors", "writer_alive", "hits_by_class": {class: blocks}}``. Tiers: ``host``, ``disk``, ``shared``.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0  # blocks served from this tier
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0  # blocks written (first writer; a key another writer had is not counted)
    evictions: int = 0
    expirations: int = 0
    corrupt_reads: int = 0  # records found bad (and removed)
    read_errors: int = 0  # reads that failed with an I/O error (EIO, EACCES, ESTALE, ...): counted misses
    write_errors: int = 0  # batches this tier failed to write (ENOSPC, EIO, ...): kept in host memory
    entries: int = 0  # gauges, refreshed by the store
    bytes: int = 0


@dataclass(slots=True)
class StoreMetrics:
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    lookups: int = 0
    lookup_blocks: int = 0  # blocks asked about
    hit_blocks: int = 0  # leading blocks found
    misses: int = 0  # lookups that found fewer blocks than asked
    saves_refused: int = 0  # saves dropped because every slot of the host tier was leased
    writes_dropped: int = 0  # saves kept in host memory only: the write-behind backlog was full
    load_errors: int = 0  # loads ended early by an unexpected error (the rest recomputed)
    writer_errors: int = 0  # unexpected errors the write-behind thread survived (a batch each)
    writer_alive: bool = True  # False once the write-behind thread has died (saves no longer reach files)
    hits_by_class: dict[str, int] = field(default_factory=dict)
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def tier(self, name: str) -> TierCounters:
        return self.tiers.setdefault(name, TierCounters())

    def observe_load(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def snapshot(self) -> dict:
        cumulative, total = [], 0
        for count in self.latency_counts:
            total += count
            cumulative.append(total)
        return {
            "tiers": {name: asdict(c) for name, c in self.tiers.items()},
            "lookups": self.lookups,
            "lookup_blocks": self.lookup_blocks,
            "hit_blocks": self.hit_blocks,
            "misses": self.misses,
            "saves_refused": self.saves_refused,
            "writes_dropped": self.writes_dropped,
            "load_errors": self.load_errors,
            "writer_errors": self.writer_errors,
            "writer_alive": self.writer_alive,
            "hits_by_class": dict(self.hits_by_class),
            "load_latency": {
                "buckets": list(LATENCY_BUCKETS),
                "counts": cumulative[:-1],
                "sum": self.latency_sum,
                "count": total,
            },
        }
