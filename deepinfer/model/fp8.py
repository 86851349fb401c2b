"""DeepSeek's FP8 weight format: float8_e4m3fn values with one float32 scale per 128x128 block.

A checkpoint stores ``W_fp8`` and ``weight_scale_inv`` such that ``W ≈ W_fp8 * scale_inv`` block-wise;
the last blocks of a dimension that is not a multiple of the block size are partial.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_block_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """weight [out, in] float8_e4m3fn, scale_inv [ceil(out/b0), ceil(in/b1)] -> float32 [out, in]."""
    out_dim, in_dim = weight.shape
    expected = (math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a "
            f"{out_dim}x{in_dim} weight in {block[0]}x{block[1]} blocks"
        )
    scales = (
        scale_inv.float().repeat_interleave(block[0], 0)[:out_dim].repeat_interleave(block[1], 1)[:, :in_dim]
    )
    return weight.float() * scales


def quantize_block_fp8(weight: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """The inverse used to write DeepSeek-layout checkpoints: per-block absmax scaling to ±448."""
    out_dim, in_dim = weight.shape
    rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
    padded = weight.float().new_zeros(rows * block[0], cols * block[1])
    padded[:out_dim, :in_dim] = weight.float()
    tiles = padded.view(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    quantized = (tiles / scale_inv[:, None, :, None]).to(FP8_DTYPE).view(rows * block[0], cols * block[1])
    return quantized[:out_dim, :in_dim].contiguous(), scale_inv
