"""The GPU benchmark script: its roofline arithmetic, its report, and its behaviour without a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "device_nvidia.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("device_nvidia", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_nvidia"] = module  # dataclasses resolve their module while the class is built
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
H200 = bench.Ceilings(copy_bytes_per_s=4.3e12, matmul_flops_per_s=790e12)


def test_mla_decode_cost_at_v3_decode_shape() -> None:
    cost = bench.mla_decode_cost(64, 4096)
    kv = 64 * 4096 * 576 * 2  # one bf16 row of latent + rope per cached token
    io = 64 * 128 * (576 + 512) * 2  # queries in, latent outputs out
    assert cost.bytes == kv + io
    assert cost.flops == 2 * 64 * 128 * 4096 * (576 + 512)
    # Two queries per request (MTP) read the same cache and double the work.
    mtp = bench.mla_decode_cost(64, 4096, queries_per_req=2)
    assert mtp.flops == 2 * cost.flops and mtp.bytes - io * 2 == kv


def test_prefill_and_moe_costs() -> None:
    assert bench.mla_prefill_cost(1).flops == 2 * 128 * 1 * (192 + 128)
    assert bench.mla_prefill_cost(4096).flops == pytest.approx(2 * 128 * 4096 * 4097 / 2 * 320)
    moe = bench.fused_moe_cost(4096, 256)
    assert moe.flops == 6 * 4096 * 8 * 7168 * 2048  # 2 x (2I x D) + 2 x (D x I) per pair
    assert moe.bound == "compute" and bench.fused_moe_cost(64, 230).bound == "memory"
    assert moe.bytes > 256 * 3 * 7168 * 2048 * 2  # every expert's weights once, plus activations


def test_fraction_of_ceiling_uses_the_matching_ceiling() -> None:
    memory = bench.Cost(bytes=4.3e9, flops=1.0, bound="memory")
    compute = bench.Cost(bytes=1.0, flops=790e9, bound="compute")
    assert bench.fraction_of_ceiling(memory, 2e-3, H200) == pytest.approx(0.5)
    assert bench.fraction_of_ceiling(compute, 4e-3, H200) == pytest.approx(0.25)


def test_targets_and_table() -> None:
    decode_cost = bench.mla_decode_cost(64, 4096)
    decode_ms = decode_cost.bytes / (0.65 * H200.copy_bytes_per_s) * 1e3  # 65% of copy bandwidth
    moe_cost = bench.fused_moe_cost(4096, 256)
    moe_ms = moe_cost.flops / (0.30 * H200.matmul_flops_per_s) * 1e3  # 30% of the matmul rate
    results = {
        "mla_decode": bench.measure("mla_decode", "B=64", decode_ms, decode_cost, H200),
        "fused_moe": bench.measure("fused_moe", "T=4096", moe_ms, moe_cost, H200),
        "sample": bench.measure("sample", "B=64", 0.04 * 61 * decode_ms, bench.streaming_cost(1e6), H200),
    }
    goals = {g.name.split()[0]: g for g in bench.targets(results, H200)}
    assert goals["mla_decode"].value == pytest.approx(0.65) and goals["mla_decode"].met
    assert goals["fused_moe"].value == pytest.approx(0.30) and not goals["fused_moe"].met
    assert goals["sample"].value == pytest.approx(0.04) and goals["sample"].met
    table = bench.format_table(list(results.values()), list(goals.values()))
    assert "PASS  mla_decode fraction of copy bandwidth: 65.0% (target >= 60%)" in table
    assert "MISS  fused_moe fraction of bf16 matmul rate: 30.0% (target >= 40%)" in table
    assert "sample fraction of a decode step: 4.0% (target < 5%)" in table


def test_help_works_anywhere() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout and "--skip-conformance" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a host without a GPU")
def test_without_a_gpu_it_stops_with_a_clear_message(tmp_path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == bench.NO_GPU_EXIT
    assert "needs a CUDA GPU" in proc.stderr
    assert not out.exists()
