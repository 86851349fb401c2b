"""RMSNorm, fused residual add + RMSNorm and the SwiGLU activation on torch_npu.

- ``rms_norm``: ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``; gamma must have x's dtype.
- ``add_rms_norm``: ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)``; the third output is
  the new residual, formed in x's dtype as the interface requires.
- ``silu_and_mul``: ``npu_swiglu(x, dim=-1)`` splits the last dimension into halves A | B and returns
  ``silu(A) * B``: gate first, then up, the interface's ``[gate | up]`` layout.
"""

from __future__ import annotations

from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.npu import torch_npu


@OPS.implement
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch_npu().npu_rms_norm(x, weight.to(x.dtype), eps)[0]


@OPS.implement
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    normed, _, summed = torch_npu().npu_add_rms_norm(x, residual, weight.to(x.dtype), eps)
    return normed, summed


@OPS.implement
def silu_and_mul(x: Tensor) -> Tensor:
    return torch_npu().npu_swiglu(x, dim=-1)
