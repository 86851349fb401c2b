"""A drained server loses none of its KV store's writes: ``deepinfer serve --kv-store-path`` with
requests just finished gets SIGTERM, exits 0, and every block its store held in host memory (saved,
possibly still in the group-commit window or the write-behind backlog) is on disk afterwards, with
the stats record written (issue 34, defect 14)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import pytest

from deepinfer.kvstore import admin
from tests.server.serve_process import serve


def _host_entries(metrics: str) -> int:
    found = re.search(r'^deepinfer_kv_store_entries\{tier="host"\} (\S+)$', metrics, re.M)
    assert found, "no host-tier entries gauge in /metrics"
    return int(float(found.group(1)))


@pytest.mark.slow
def test_a_sigterm_drain_writes_every_saved_block_to_disk(deepseek_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    with serve(deepseek_model, "--kv-store-path", str(store)) as served:
        for i in range(4):
            prompt = f"def function_{i}(x):\n    return x * {i}\n" * 20
            r = httpx.post(
                f"{served.url}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        saved = _host_entries(httpx.get(f"{served.url}/metrics", timeout=10).text)
        assert saved > 0
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=120) == 0, served.output[-3000:]
    found = admin.stats(store)
    assert sum(ns["entries"] for ns in found) == saved, found
    assert list(store.rglob("stats/*.json")), "the store's stats record was not written on the drain"
