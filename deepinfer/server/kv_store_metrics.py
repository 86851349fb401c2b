"""Prometheus series of the KV store, from its plain-data snapshot (``deepinfer.kvstore.metrics``).

Read at scrape time by the server's engine collector; the store itself never imports
prometheus-client. Series: ``deepinfer_kv_store_{hits,bytes_read,bytes_written,writes,evictions,
expirations,corrupt_reads}_total{tier}``, ``deepinfer_kv_store_{entries,bytes}{tier}``,
``deepinfer_kv_store_lookup_{blocks,hit_blocks,misses}_total``,
``deepinfer_kv_store_saves_refused_total`` and the ``deepinfer_kv_store_load_seconds`` histogram.
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
}


def kv_store_families(snapshot: dict) -> Iterator[Metric]:
    tiers = snapshot["tiers"]
    for name, help_text in COUNTERS.items():
        family = CounterMetricFamily(f"deepinfer_kv_store_{name}", help_text, labels=["tier"])
        for tier, values in tiers.items():
            family.add_metric([tier], values[name])
        yield family
    for name, help_text in (("entries", "Blocks held by the tier"), ("bytes", "Bytes held by the tier")):
        family = GaugeMetricFamily(f"deepinfer_kv_store_{name}", help_text, labels=["tier"])
        for tier, values in tiers.items():
            family.add_metric([tier], values[name])
        yield family
    for name, help_text in (
        ("lookup_blocks", "Blocks looked up in the store"),
        ("hit_blocks", "Leading blocks found by lookups"),
        ("misses", "Lookups that found fewer blocks than asked"),
        ("saves_refused", "Block saves dropped because every host slot was leased"),
    ):
        yield CounterMetricFamily(f"deepinfer_kv_store_{name}", help_text, value=snapshot[name])
    lat = snapshot["load_latency"]
    buckets = [(str(b), c) for b, c in zip(lat["buckets"], lat["counts"])] + [("+Inf", lat["count"])]
    yield HistogramMetricFamily(
        "deepinfer_kv_store_load_seconds",
        "Time to load a batch of blocks",
        buckets=buckets,
        sum_value=lat["sum"],
    )
