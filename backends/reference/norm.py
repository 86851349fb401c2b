"""Reference RMSNorm, fused add + RMSNorm, and the SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.reference import OPS


@OPS.implement
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


@OPS.implement
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


@OPS.implement
def silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
