"""Small model building blocks: linear layers, RMSNorm, the dense SwiGLU MLP.

Weights are allocated uninitialised (the loader fills every one of them and checks that it did).
Every accelerator-specific computation goes through the op interface (``deepinfer.backends.ops``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.backends import ops


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``; weight [out, in] as in nn.Linear."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(hidden, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``(rms_norm(x + residual), x + residual)``."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class MLP(nn.Module):
    """Dense SwiGLU MLP with gate and up projections merged into one [2I, D] weight."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
