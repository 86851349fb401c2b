"""Prometheus series of the KV store, from its plain-data snapshot (``deepinfer.kvstore.metrics``).

Read at scrape time by the server's engine collector; the store itself never imports
prometheus-client. Series: ``deepinfer_kv_store_{hits,bytes_read,bytes_written,writes,evictions,
expirations,corrupt_reads}_total{tier}``, ``deepinfer_kv_store_{entries,bytes}{tier}``,
``deepinfer_kv_store_lookup_{blocks,hit_blocks,misses}_total``,
``deepinfer_kv_store_saves_refused_total``, ``deepinfer_kv_store_writes_dropped_total`` and the ``deepinfer_kv_store_load_seconds`` histogram.
With several engine cores (data-parallel ranks), each has its own store client and counters: every
series then carries a ``rank`` label, one sample per core (``sum by (tier)`` gives the server's total;
a disk or shared tier's ``entries``/``bytes`` are each rank's view of one directory, so not a sum).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

COUNTERS = {
    "hits": "Blocks served from the tier",
    "bytes_read": "Bytes read from the tier",
    "bytes_written": "Bytes written to the tier",
    "writes": "Blocks written to the tier",
    "evictions": "Blocks evicted from the tier for capacity",
    "expirations": "Expired blocks collected from the tier",
    "corrupt_reads": "Bad records found in the tier (each a miss, removed)",
    "read_errors": "Reads of the tier that failed with an I/O error (each a miss)",
    "write_errors": "Write-behind batches the tier failed to write (kept in host memory)",
}


def kv_store_families(snapshots: dict[str | None, dict]) -> Iterator[Metric]:
    """The store series from per-core snapshots: ``{None: snapshot}`` for one core (no ``rank``
    label), ``{"0": snapshot, "1": ...}`` for data-parallel ranks (a ``rank`` label)."""
    extra = [] if None in snapshots else ["rank"]

    def labels(rank: str | None, *rest: str) -> list[str]:
        return [*rest, *([] if rank is None else [rank])]

    for name, help_text in COUNTERS.items():
        family = CounterMetricFamily(f"deepinfer_kv_store_{name}", help_text, labels=["tier", *extra])
        for rank, snapshot in snapshots.items():
            for tier, values in snapshot["tiers"].items():
                family.add_metric(labels(rank, tier), values[name])
        yield family
    for name, help_text in (("entries", "Blocks held by the tier"), ("bytes", "Bytes held by the tier")):
        family = GaugeMetricFamily(f"deepinfer_kv_store_{name}", help_text, labels=["tier", *extra])
        for rank, snapshot in snapshots.items():
            for tier, values in snapshot["tiers"].items():
                family.add_metric(labels(rank, tier), values[name])
        yield family
    for name, help_text in (
        ("lookup_blocks", "Blocks looked up in the store"),
        ("hit_blocks", "Leading blocks found by lookups"),
        ("misses", "Lookups that found fewer blocks than asked"),
        ("saves_refused", "Block saves dropped because every host slot was leased"),
        ("writes_dropped", "Block saves kept in host memory only because the write-behind backlog was full"),
        ("load_errors", "Loads ended early by an unexpected error (the rest recomputed)"),
        ("writer_errors", "Unexpected errors the write-behind thread survived (one batch each)"),
    ):
        family = CounterMetricFamily(f"deepinfer_kv_store_{name}", help_text, labels=extra)
        for rank, snapshot in snapshots.items():
            family.add_metric(labels(rank), snapshot[name])
        yield family
    family = GaugeMetricFamily(
        "deepinfer_kv_store_writer_alive",
        "1 while the write-behind thread runs, 0 once it died",
        labels=extra,
    )
    for rank, snapshot in snapshots.items():
        family.add_metric(labels(rank), 1 if snapshot["writer_alive"] else 0)
    yield family
    family = HistogramMetricFamily(
        "deepinfer_kv_store_load_seconds", "Time to load a batch of blocks", labels=extra
    )
    for rank, snapshot in snapshots.items():
        lat = snapshot["load_latency"]
        buckets = [(str(b), c) for b, c in zip(lat["buckets"], lat["counts"])] + [("+Inf", lat["count"])]
        family.add_metric(labels(rank), buckets, lat["sum"])
    yield family
