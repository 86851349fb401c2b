"""Deterministic (batch-invariant) formulations of the quantised-weight ops on Ascend (issue 29).

torch_npu's documentation states batch invariance for none of ``npu_quant_matmul``,
``npu_grouped_matmul`` or the plain matmul, so deterministic mode runs the reference's
one-GEMM-shape formulations (``deepinfer.backends.reference.invariant``: row counts padded to whole
tiles, one product per expert) on weights decoded by ``deepinfer.ops_ascend.quant`` from their bytes,
not the reference's own ``quant.dequantize``, whose FP8 casts A2 / A3 cannot run. That the NPU's
matmul over one padded shape is invariant is a claim only an Ascend run can check (``ci/ascend.sh``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.backends.quant import WeightFormat, check_pair, expand_scale
from deepinfer.backends.reference.deterministic import fused_moe as invariant_fused_moe
from deepinfer.backends.reference.invariant import tiled_grouped, tiled_linear
from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.quant import check_experts, check_linear, dequantize_to, e4m3_to_float


def _invariant_note(kernel: str) -> str:
    return (
        f"torch_npu's documentation does not state batch invariance for {kernel}: the reference's "
        "one-GEMM-shape formulation on weights decoded from their bytes (no FP8 arithmetic, which A2/A3 lack)"
    )


@OPS.implement_invariant(_invariant_note("matmul"))
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    fmt = check_linear(x, weight, weight_scale, block, bias, "fp8_linear")
    w = dequantize_to(weight, weight_scale, fmt, torch.float32)
    return tiled_linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


@OPS.implement_invariant(_invariant_note("npu_quant_matmul"))
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    fmt = check_linear(x_values, weight, weight_scale, block, bias, "fp8_linear_w8a8")
    check_pair(x_values, x_scale, WeightFormat("fp8", (1, block[1])), "fp8_linear_w8a8 activations")
    x = e4m3_to_float(x_values) * expand_scale(x_scale, (1, block[1]), *x_values.shape)
    w = dequantize_to(weight, weight_scale, fmt, torch.float32)
    return tiled_linear(x, w, None if bias is None else bias.float()).to(out_dtype)


@OPS.implement_invariant(_invariant_note("npu_grouped_matmul") + ", one product per expert")
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    check_experts(weight, weight_scale, fmt, "grouped_gemm_quant weight")
    w = dequantize_to(weight, weight_scale, fmt, torch.float32)
    return tiled_grouped(x.float(), w, group_sizes.tolist()).to(x.dtype)


@OPS.implement_invariant(_invariant_note("npu_grouped_matmul") + "; the reference's invariant fused_moe")
def fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    check_experts(w13, w13_scale, fmt, "fused_moe_quant w13")
    check_experts(w2, w2_scale, fmt, "fused_moe_quant w2")
    w13_f = dequantize_to(w13, w13_scale, fmt, torch.float32)
    w2_f = dequantize_to(w2, w2_scale, fmt, torch.float32)
    return invariant_fused_moe(hidden.float(), w13_f, w2_f, topk_weights, topk_ids).to(hidden.dtype)
