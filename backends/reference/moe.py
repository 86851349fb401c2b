"""Reference DeepSeek routing, grouped GEMM and the fused routed-expert MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from deepinfer.backends.reference import OPS
from deepinfer.backends.reference.norm import silu_and_mul


@OPS.implement
def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    return route(
        router_logits, correction_bias, top_k, n_group, topk_group, scoring_func, topk_method, renormalize,
        routed_scaling_factor, lambda w: w.sum(dim=-1, keepdim=True), torch.sigmoid,
    )  # fmt: skip


def route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    renormalize: bool,
    routed_scaling_factor: float,
    row_sum: Callable[[Tensor], Tensor],
    sigmoid: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """``moe_route``, with ``row_sum`` ([T, k] -> [T, 1]) adding up each token's top-k weights and
    ``sigmoid`` the scoring function's elementwise code."""
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = sigmoid(logits)
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    num_tokens, num_experts = scores.shape

    if topk_method == "noaux_tc":
        if correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs correction_bias (e_score_correction_bias)")
        choice = scores + correction_bias.float()
        group_scores = choice.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    elif topk_method == "group_limited_greedy":
        choice = scores
        group_scores = choice.view(num_tokens, n_group, -1).max(dim=-1).values
    elif topk_method == "greedy":
        choice, group_scores = scores, None
    else:
        raise ValueError(
            f"topk_method must be 'noaux_tc', 'greedy' or 'group_limited_greedy', got {topk_method!r}"
        )

    if group_scores is not None and topk_group < n_group:
        kept_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_mask = group_mask.repeat_interleave(num_experts // n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))

    expert_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / (row_sum(weights) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, expert_ids.to(torch.int32)


@OPS.implement
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            torch.matmul(x[start : start + size], weight[expert].t(), out=out[start : start + size])
            start += size
    if start != x.shape[0]:
        raise ValueError(f"group_sizes sum to {start}, but x has {x.shape[0]} rows")
    return out


@OPS.implement
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    expert_of_pair = topk_ids.reshape(-1).long()
    token_of_pair = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
    weight_of_pair = topk_weights.reshape(-1).float()
    local = expert_of_pair >= 0
    if not bool(local.all()):
        expert_of_pair, token_of_pair, weight_of_pair = (
            expert_of_pair[local],
            token_of_pair[local],
            weight_of_pair[local],
        )
    order = torch.argsort(expert_of_pair, stable=True)
    experts, tokens, weights = expert_of_pair[order], token_of_pair[order], weight_of_pair[order]
    group_sizes = torch.bincount(experts, minlength=num_experts)

    gate_up = grouped_gemm(hidden.index_select(0, tokens), w13, group_sizes)
    expert_out = grouped_gemm(silu_and_mul(gate_up), w2, group_sizes)

    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, expert_out.float() * weights[:, None])
    return out.to(hidden.dtype)
