"""The quantised-weight additions to the GPU benchmark script: costs, the FP8 peak table, the W8A8 goal."""

from __future__ import annotations

import pytest

from tests.nvidia.test_bench import H200, bench


def test_w8a8_cost_at_the_goal_shape() -> None:
    cost = bench.w8a8_gemm_cost(4096, 7168, 7168)
    assert cost.flops == 2 * 4096 * 7168 * 7168 and cost.bound == "compute"
    scales = 4 * (4096 * 56 + 56 * 56)  # [M, K/128] activation and [N/128, K/128] weight scales
    assert cost.bytes == 4096 * 7168 + 7168 * 7168 + scales + 4096 * 7168 * 2


def test_quantised_moe_reads_fewer_weight_bytes() -> None:
    bf16 = bench.fused_moe_cost(64, 230)
    fp8 = bench.fused_moe_quant_cost(64, 230, 8.0)
    fp4 = bench.fused_moe_quant_cost(64, 230, 4.25)
    weights = 230 * 3 * 7168 * 2048
    assert bf16.bytes - fp8.bytes == pytest.approx(weights)  # 2 bytes -> 1 byte a weight
    assert fp8.bytes - fp4.bytes == pytest.approx(weights * 3.75 / 8)
    assert fp8.flops == bf16.flops and fp8.bound == bf16.bound == "memory"


def test_fp8_peak_by_device_name() -> None:
    assert bench.fp8_dense_peak("NVIDIA H200") == 1979e12
    assert bench.fp8_dense_peak("NVIDIA H100 80GB HBM3") == 1979e12
    assert bench.fp8_dense_peak("NVIDIA H100 PCIe") == 1513e12
    assert bench.fp8_dense_peak("NVIDIA A100-SXM4-80GB") is None  # no FP8 tensor cores


def test_w8a8_goal_uses_the_triton_kernel_and_the_peak() -> None:
    cost = bench.w8a8_gemm_cost(4096, 7168, 7168)
    ms = cost.flops / (0.65 * 1979e12) * 1e3  # 65% of the H200's FP8 peak
    results = {"fp8_linear_w8a8_triton": bench.measure("fp8_linear_w8a8_triton", "M=4096", ms, cost, H200)}
    (goal,) = bench.quant_targets(results, 1979e12, 1500e12)
    assert goal.value == pytest.approx(0.65) and goal.met and "FP8 dense peak" in goal.name
    (measured,) = bench.quant_targets(results, None, 2 * 1979e12)
    assert measured.value == pytest.approx(0.325) and not measured.met and "measured" in measured.name
    assert bench.quant_targets(results, None, None) == []
    assert bench.quant_targets({}, 1979e12, None) == []
