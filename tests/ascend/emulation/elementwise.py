"""Emulated normalisation, activation and rotary ops, from their documentation (torch_npu 2.13.0).

- ``npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)``: float16/bfloat16/float32, 2-8 dims, gamma in
  self's dtype; statistics in float32.
- ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x1 + x2)`` (schema and meta registration;
  the docstring file has no entry): x1, x2 of one shape and dtype, gamma in that dtype.
- ``npu_swiglu(self, dim=-1)``: halves A | B along ``dim``, returns silu(A) * B.
- ``npu_rotary_mul(input, r1, r2, rotary_mode='half')``: 4-D input, r1/r2 4-D in input's dtype;
  'half': ``r1 * x + r2 * cat(-x2, x1)``; 'interleave': ``r1 * x + r2 * pairs(-x[2i+1], x[2i])`` with r1/r2
  broadcast as 11SD / 1S1D / S11D only and B * N < 1000; D even and < 896.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.ascend.emulation.runtime import npu_op

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise RuntimeError(f"{op}: {message}")


def _rms(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@npu_op
def npu_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    _require(x.dtype in FLOATS and 2 <= x.dim() <= 8, "npu_rms_norm", "float16/bfloat16/float32, 2-8 dims")
    _require(gamma.dtype == x.dtype and gamma.shape == x.shape[-1:], "npu_rms_norm", "gamma [D] in x's dtype")
    return _rms(x, gamma, epsilon)


@npu_op
def npu_add_rms_norm(
    x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6
) -> tuple[Tensor, Tensor, Tensor]:
    op = "npu_add_rms_norm"
    _require(
        x1.shape == x2.shape and x1.dtype == x2.dtype and x1.dtype in FLOATS,
        op,
        "x1, x2: one shape, one dtype",
    )
    _require(gamma.dtype == x1.dtype and gamma.shape == x1.shape[-1:], op, "gamma [D] in x's dtype")
    summed = x1 + x2
    y, rstd = _rms(summed, gamma, epsilon)
    return y, rstd, summed


@npu_op
def npu_swiglu(x: Tensor, dim: int = -1) -> Tensor:
    _require(
        x.dtype in FLOATS and x.shape[dim] % 2 == 0, "npu_swiglu", "float input with an even split dimension"
    )
    gate, up = x.float().chunk(2, dim=dim)
    return (F.silu(gate) * up).to(x.dtype)


@npu_op
def npu_rotary_mul(
    x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half", rotate: Tensor | None = None
) -> Tensor:
    op = "npu_rotary_mul"
    _require(rotate is None, op, "the rotate matrix is not emulated")
    _require(x.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, op, "4-D input, r1 and r2")
    _require(
        x.dtype in FLOATS and r1.dtype == x.dtype and r2.dtype == x.dtype, op, "r1 / r2 in the input's dtype"
    )
    width = x.shape[-1]
    _require(
        width % 2 == 0 and width < 896 and r1.shape[-1] == width, op, "D even, below 896, equal in r1 / r2"
    )
    xf = x.float()
    if rotary_mode == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        spread = [i for i in range(3) if r1.shape[i] != 1]
        _require(
            len(spread) <= 1 and all(r1.shape[i] == x.shape[i] for i in spread),  # 1111D: one token
            op,
            "interleave mode broadcasts r1 / r2 as 11SD, 1S1D or S11D only",
        )
        seq_dim = spread[0] if spread else 1  # one token: read as 1S1D with S = 1
        others = [x.shape[i] for i in range(3) if i != seq_dim]
        _require(others[0] * others[1] < 1000, op, "interleave mode needs B * N < 1000")
        rotated = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise RuntimeError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return (r1.float() * xf + r2.float() * rotated).to(x.dtype)
