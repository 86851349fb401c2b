"""Grouped GEMM and the fused routed-expert MLP over ``torch._grouped_mm``: no loop over experts.

``torch._grouped_mm(x, w, offs)`` multiplies consecutive row groups of ``x`` ([N, K]) by the matching
``w[e]`` ([E, K, Nout]) in one call, with group ends ``offs`` ([E] int32 prefix sums). On the CPU it
needs row strides that are multiples of 16 bytes, so an odd inner width is zero-padded (exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()
_ALIGN_BYTES = 16


def _grouped(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """``out[r] = weight[e(r)] @ x[r]`` for expert-sorted rows with group ends ``offs``; [N, Nout]."""
    inner = x.shape[1]
    align = _ALIGN_BYTES // x.element_size()
    if inner % align:
        pad = align - inner % align
        x, weight = F.pad(x, (0, pad)), F.pad(weight, (0, pad))
    return torch._grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offs)


@OPS.implement
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    offs = group_sizes.cumsum(0).to(torch.int32)
    total = int(offs[-1]) if offs.numel() else 0  # a host read, not a device sync, on the CPU
    if total != x.shape[0]:
        raise ValueError(f"group_sizes sum to {total}, but x has {x.shape[0]} rows")
    return _grouped(x, weight, offs)


@OPS.implement
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    # Pairs for another rank's experts (id < 0) run through expert 0 with weight 0: the shapes stay
    # fixed and nothing depends on how many there are.
    remote = ids < 0
    weights = weights.masked_fill(remote, 0.0)
    ids = ids.masked_fill(remote, 0)
    order = torch.argsort(ids, stable=True)
    tokens = order // top_k
    offs = torch.bincount(ids, minlength=num_experts).cumsum(0).to(torch.int32)
    gate_up = _grouped(hidden.index_select(0, tokens), w13, offs)
    expert_out = _grouped(_native.silu_and_mul(gate_up), w2, offs)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, expert_out.float() * weights[order, None])
    return out.to(hidden.dtype)
