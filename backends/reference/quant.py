"""Reference ops for quantised weights: dequantise (``deepinfer.backends.quant``), then the
high-precision reference op. The definition every backend's quantised kernels are checked against."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.backends.quant import WeightFormat, check_pair, dequantize, quantize_activations_fp8
from deepinfer.backends.reference import OPS
from deepinfer.backends.reference.moe import fused_moe, grouped_gemm


@OPS.implement
def quant_fp8_group(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    if group < 1:
        raise ValueError(f"quant_fp8_group: group must be positive, got {group}")
    return quantize_activations_fp8(x, group, ue8m0)


def dequantize_fp8(weight: Tensor, weight_scale: Tensor, block: tuple[int, int]) -> Tensor:
    """[..., N, K] FP8 pair -> float32 weights (validated)."""
    return dequantize(weight, weight_scale, WeightFormat("fp8", tuple(block)))


@OPS.implement
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    w = dequantize_fp8(weight, weight_scale, block)
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


@OPS.implement
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    check_pair(x_values, x_scale, WeightFormat("fp8", (1, block[1])), "fp8_linear_w8a8 activations")
    x = dequantize(x_values, x_scale, WeightFormat("fp8", (1, block[1])))
    w = dequantize_fp8(weight, weight_scale, block)
    out = torch.nn.functional.linear(x, w, None if bias is None else bias.float())
    return out.to(out_dtype)


@OPS.implement
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    w = dequantize(weight, weight_scale, fmt)
    return grouped_gemm(x.float(), w, group_sizes).to(x.dtype)


@OPS.implement
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
    out = fused_moe(
        hidden.float(), dequantize(w13, w13_scale, fmt), dequantize(w2, w2_scale, fmt), topk_weights, topk_ids
    )
    return out.to(hidden.dtype)
