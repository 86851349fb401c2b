"""Routed-expert compute on torch_npu: grouped GEMM and the fused MoE MLP.

``grouped_gemm``: ``npu_grouped_matmul([x], [W], group_list=sizes, split_item=2, group_type=0,
group_list_type=1)`` (doc: "single x, single 3-D weight, single y", rows of x split along M by per-group
COUNTS when group_list_type is 1, at most 1024 groups, inner dimensions below 65536). The interface's
weight is [E, Nout, K] (nn.Linear per expert); the op multiplies x [M, K] by weight [E, K, N] and accepts a
transposed weight, so ``weight.transpose(1, 2)`` is passed as a view, without a copy.

``fused_moe``:
1. ``npu_moe_init_routing_v2(hidden, ids, expert_num=E + 1, active_expert_range=[0, E],
   expert_tokens_num_type=1, expert_tokens_num_flag=True, row_idx_type=0)`` sorts the (token, k) pairs by
   expert into ``expanded_x`` [T*k, D] (valid rows first), returns per-expert counts and, per pair
   (``t * k + j``), its row in ``expanded_x`` (-1 for a pair outside the active range). Remote experts
   (negative ids) are mapped to id E, a valid id outside the active range, so they are dropped;
2. gate/up GEMM, ``npu_swiglu``, down GEMM, all with the counts as ``group_list``;
3. ``npu_moe_token_unpermute(out, row_idx, probs)`` gathers each pair's row, weights and sums it per token.
   It requires a permutation of [0, T*k) (no duplicates, no -1): dropped pairs are pointed at the unused
   rows after the valid ones (which are zeroed: the GEMMs never write them) and given weight 0.
Everything stays on the device: no host synchronisation, so the MoE layer is graph-capturable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.npu import torch_npu

MAX_GROUPS = 1024


def _grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """``x @ weight[e].T`` per group of rows, ``weight`` [E, Nout, K], ``counts`` [E] int64."""
    if weight.shape[0] > MAX_GROUPS:
        raise ValueError(f"npu_grouped_matmul takes at most {MAX_GROUPS} groups, got {weight.shape[0]}")
    (out,) = torch_npu().npu_grouped_matmul(
        [x], [weight.transpose(1, 2)], group_list=counts, split_item=2, group_type=0, group_list_type=1
    )
    return out


@OPS.implement
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    return _grouped_matmul(x.contiguous(), weight, group_sizes.to(torch.int64))


@OPS.implement
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    npu = torch_npu()
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    remote = topk_ids < 0
    ids = torch.where(remote, num_experts, topk_ids).to(torch.int32)
    expanded, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        hidden.contiguous(),
        ids,
        expert_num=num_experts + 1,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[0, num_experts],
        row_idx_type=0,
    )
    gate_up = _grouped_matmul(expanded, w13, counts)
    out = _grouped_matmul(npu.npu_swiglu(gate_up, dim=-1), w2, counts)

    pairs = num_tokens * top_k
    valid = counts.sum()
    rows = torch.arange(pairs, device=hidden.device)
    out = torch.where((rows < valid)[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    dropped = row_idx < 0
    spare = valid + torch.cumsum(dropped, 0) - 1
    row_idx = torch.where(dropped, spare, row_idx).to(torch.int32)
    probs = torch.where(remote, 0.0, topk_weights.float()).to(out.dtype)
    return npu.npu_moe_token_unpermute(out, row_idx, probs=probs)
