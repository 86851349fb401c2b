"""Per-rank series in ``/metrics``: each data-parallel rank's running and waiting requests, KV usage,
expert-token load, and its KV-store counters under a ``rank`` label (rendered from per-core stats;
tests/parallel/test_serve_official_clients.py checks them on a live two-rank server)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deepinfer.core.messages import EngineStats
from deepinfer.kvstore.metrics import StoreMetrics
from deepinfer.parallel.expert_load import ExpertLoadRecorder
from deepinfer.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def store_snapshot(hits: int, misses: int, written: int) -> dict:
    m = StoreMetrics()
    m.tier("host").hits = hits
    m.tier("disk").bytes_written = written
    m.misses = misses
    m.observe_load(0.003)
    return m.snapshot()


def test_each_rank_gets_its_own_series() -> None:
    cores = {
        0: EngineStats(3, 1, 100, 60, kv_store=store_snapshot(5, 2, 4096), expert_tokens_per_step=12.5),
        1: EngineStats(1, 0, 100, 90, kv_store=store_snapshot(7, 1, 1024), expert_tokens_per_step=3.0),
    }
    total = EngineStats(4, 1, 200, 150)
    got = samples(ServerMetrics(lambda: total, lambda: 5, lambda: cores))
    for rank, running, waiting, usage, experts in (("0", 3, 1, 0.4, 12.5), ("1", 1, 0, 0.1, 3.0)):
        label = (("rank", rank),)
        assert got[("deepinfer_dp_rank_num_requests_running", label)] == running
        assert got[("deepinfer_dp_rank_num_requests_waiting", label)] == waiting
        assert abs(got[("deepinfer_dp_rank_kv_cache_usage_ratio", label)] - usage) < 1e-9
        assert got[("deepinfer_dp_rank_expert_tokens_per_step", label)] == experts
    assert got[("deepinfer_num_requests_running", ())] == 4  # the server's totals stay
    # the store's counters: one sample per rank, which sum to the server's total
    hits = {k[1]: v for k, v in got.items() if k[0] == "deepinfer_kv_store_hits_total"}
    assert hits[(("rank", "0"), ("tier", "host"))] == 5 and hits[(("rank", "1"), ("tier", "host"))] == 7
    misses = {k[1]: v for k, v in got.items() if k[0] == "deepinfer_kv_store_misses_total"}
    assert misses == {(("rank", "0"),): 2, (("rank", "1"),): 1}
    written = [v for k, v in got.items() if k[0] == "deepinfer_kv_store_bytes_written_total"]
    assert sum(written) == 4096 + 1024
    loads = {k[1]: v for k, v in got.items() if k[0] == "deepinfer_kv_store_load_seconds_count"}
    assert loads == {(("rank", "0"),): 1, (("rank", "1"),): 1}


def test_one_core_has_no_rank_series_and_no_rank_label() -> None:
    core = EngineStats(2, 0, 100, 50, kv_store=store_snapshot(4, 1, 0))
    got = samples(ServerMetrics(lambda: core, lambda: 2, lambda: {0: core}))
    assert not [k for k in got if k[0].startswith("deepinfer_dp_rank_")]
    assert got[("deepinfer_kv_store_hits_total", (("tier", "host"),))] == 4
    assert got[("deepinfer_kv_store_misses_total", ())] == 1


def test_expert_tokens_per_step_is_the_window_mean() -> None:
    recorder = ExpertLoadRecorder([1, 2], num_experts=4, window=2)
    assert recorder.received_per_step() == 0.0
    for pairs in (10, 20, 30):  # the window keeps the last two steps
        recorder.record_received(1, pairs)
        recorder.record_received(2, 1)
        recorder.advance()
    recorder.record_received(1, 1000)  # the open step is not counted
    assert recorder.received_per_step() == ((20 + 1) + (30 + 1)) / 2
