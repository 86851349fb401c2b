"""Expert-parallel dispatch and combine over NCCL (``torch.distributed.all_to_all_single``).

Dispatch groups the (token, expert) pairs by destination rank on the device, exchanges the per-rank
counts (device tensors, as NCCL requires), then two payloads: the token rows, and the local expert id
and routing weight of each pair packed into one int32 [P, 2] tensor. Combine sends the expert outputs
back in their own dtype (half the bytes of float32 for bf16) and applies the routing weights on the
token's own rank with the deterministic fused_moe combine kernel, accumulating in float32. Learning the
receive counts needs one host synchronisation per dispatch, as any variable-size all-to-all does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer.backends.collectives import all_to_all, world_size
from deepinfer.backends.ops import EPDispatch
from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.moe import combine_pairs, inverse_order
from deepinfer.ops_cuda.runtime import check_device


@dataclass(slots=True)
class _Handle:
    row_of_pair: Tensor  # [T, k] int64: where pair (t, j) sits among the rows sent (and returned)
    weights: Tensor  # [T, k] float32 routing weights
    send_splits: list[int]
    recv_splits: list[int]


@OPS.implement
def ep_dispatch(
    hidden: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    group: Any | None,
) -> EPDispatch:
    """hidden: [T, D]; topk_ids: [T, k] global expert ids; topk_weights: [T, k] float32. Collective."""
    check_device(hidden, topk_ids, topk_weights)
    world = world_size(group)
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} ranks")
    per_rank = num_experts // world
    top_k = topk_ids.shape[1]
    expert = topk_ids.reshape(-1).to(torch.int64)
    dest = expert // per_rank
    order = torch.argsort(dest, stable=True)
    send_hidden = hidden.index_select(0, order // top_k)
    weights = topk_weights.to(torch.float32)
    meta = torch.stack(
        ((expert[order] % per_rank).to(torch.int32), weights.reshape(-1)[order].view(torch.int32)), dim=1
    )
    if world == 1:
        splits = [order.numel()]
        recv_splits = send_splits = splits
        recv_hidden, recv_meta = send_hidden, meta
    else:
        send_counts = torch.zeros(world, dtype=torch.int64, device=hidden.device)
        send_counts.scatter_add_(0, dest, torch.ones_like(dest))
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = torch.stack((send_counts, recv_counts)).tolist()
        recv_hidden = all_to_all(send_hidden, send_splits, recv_splits, group)
        recv_meta = all_to_all(meta, send_splits, recv_splits, group)
    handle = _Handle(inverse_order(order).view_as(topk_ids), weights, send_splits, recv_splits)
    return EPDispatch(
        recv_hidden, recv_meta[:, 0].contiguous(), recv_meta[:, 1].contiguous().view(torch.float32), handle
    )


@OPS.implement
def ep_combine(expert_out: Tensor, dispatch: EPDispatch, group: Any | None) -> Tensor:
    """expert_out: [N, D], in the order of ``dispatch.hidden``. Returns [T, D] in its dtype. Collective."""
    check_device(expert_out)
    handle: _Handle = dispatch.handle
    returned = expert_out
    if world_size(group) > 1:
        returned = all_to_all(expert_out, handle.recv_splits, handle.send_splits, group)
    return combine_pairs(returned, handle.row_of_pair, handle.weights)
