"""Dense projections for the CPU: ``F.linear`` (MKL) for [T, K] inputs, one ``torch.bmm`` for the
per-head form.

The per-head form is MLA's absorbed W_UK / W_UV at decode (x [T, H, K], weight [H, N, K], a strided
view of ``kv_b_proj``). ``torch.einsum`` (the reference) plans the contraction, permutes and reshapes
on every call; at a decode batch of one that planning costs several times the product itself. Here
the operands are handed to ``bmm`` as transposed views (no copy: ``bmm`` takes any strides whose last
dimension is unit or whose second-to-last is) and the result comes back as a [T, H, N] view of the
[H, T, N] product, the same values as the reference's einsum, which contracts through the same bmm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.cpu.backend import OPS


@OPS.implement
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if x.dim() == 3:
        if bias is not None:
            raise ValueError("linear: a per-head weight [H, N, K] takes no bias")
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
    return F.linear(x, weight, bias)
