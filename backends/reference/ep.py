"""Reference expert-parallel dispatch/combine over any torch.distributed group (gloo on CPU).

Two ``all_to_all_single`` rounds per direction: split sizes first, then the payload. With no group or a
world size of 1 nothing is communicated and dispatch is a local regrouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer.backends.collectives import all_to_all, world_size
from deepinfer.backends.ops import EPDispatch
from deepinfer.backends.reference import OPS


@dataclass(slots=True)
class _Handle:
    token_of_pair: Tensor  # [P] token index of each sent pair, in send order
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


@OPS.implement
def ep_dispatch(
    hidden: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    group: Any | None,
) -> EPDispatch:
    world = world_size(group)
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} ranks")
    per_rank = num_experts // world
    num_tokens, top_k = topk_ids.shape
    expert_of_pair = topk_ids.reshape(-1).long()
    dest = expert_of_pair // per_rank
    order = torch.argsort(dest, stable=True)
    token_of_pair = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)[order]
    send_hidden = hidden.index_select(0, token_of_pair)
    send_experts = (expert_of_pair[order] % per_rank).to(torch.int64)
    send_weights = topk_weights.reshape(-1)[order].float()
    send_splits = torch.bincount(dest, minlength=world).tolist()

    if world == 1:
        recv_splits = send_splits
        recv_hidden, recv_experts, recv_weights = send_hidden, send_experts, send_weights
    else:
        counts = torch.tensor(send_splits, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_splits = recv_counts.tolist()
        recv_hidden = all_to_all(send_hidden, send_splits, recv_splits, group)
        recv_experts = all_to_all(send_experts, send_splits, recv_splits, group)
        recv_weights = all_to_all(send_weights, send_splits, recv_splits, group)
    handle = _Handle(token_of_pair, send_splits, recv_splits, num_tokens)
    return EPDispatch(recv_hidden, recv_experts.to(torch.int32), recv_weights, handle)


@OPS.implement
def ep_combine(expert_out: Tensor, dispatch: EPDispatch, group: Any | None) -> Tensor:
    handle: _Handle = dispatch.handle
    weighted = expert_out.float() * dispatch.weights[:, None]
    if world_size(group) > 1:
        weighted = all_to_all(weighted, handle.recv_splits, handle.send_splits, group)
    out = torch.zeros(handle.num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, handle.token_of_pair, weighted)
    return out.to(expert_out.dtype)
