"""Reference dense projection: one ``F.linear`` (MKL picks its kernel by the row count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.reference import OPS


@OPS.implement
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if x.dim() == 3:
        if bias is not None:
            raise ValueError("linear: a per-head weight [H, N, K] takes no bias")
        return torch.einsum("thk,hnk->thn", x, weight)
    return F.linear(x, weight, bias)
