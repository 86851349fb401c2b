"""DeepSeek expert routing in one kernel: scoring, group limiting and top-k selection per token.

Covers noaux_tc (V3: sigmoid scores, selection on scores + correction bias, groups ranked by the sum of
their two best biased scores), greedy and group_limited_greedy (V2: groups ranked by their best score),
with sigmoid or softmax scoring. A program routes BLOCK_T tokens over all experts held in registers;
selections are repeated arg-max passes (k and topk_group are small), ties going to the lower index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2

_NO_GROUPS, _TOP2_SUM, _BEST = 0, 1, 2  # how groups are scored (GROUP_SCORE)


@triton.jit
def _first_max(values, index, NONE: tl.constexpr):
    """Per row of ``values`` [R, C]: (max, smallest column index holding it)."""
    best = tl.max(values, axis=1)
    return best, tl.min(tl.where(values == best[:, None], index[None, :], NONE), axis=1)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    T,
    E,
    stride_t,
    n_group,
    kept_groups,
    scaling,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SCORE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    logits = tl.load(
        logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :],
        mask=t_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    logits = tl.where(e_ok[None, :], logits, float("-inf"))  # padding experts: never scored or chosen
    if SOFTMAX:
        z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = z / tl.sum(z, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(e_ok[None, :], choice, float("-inf"))

    if GROUP_SCORE != 0:
        group = e // (E // n_group)
        g_idx = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in range(n_group):
            in_group = tl.where((group == g)[None, :], choice, float("-inf"))
            best, first = _first_max(in_group, e, BLOCK_E)
            if GROUP_SCORE == 1:  # _TOP2_SUM: add the group's second-best score
                best += tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), in_group), axis=1)
            group_score = tl.where(g_idx[None, :] == g, best[:, None], group_score)
        expert_kept = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
        for _ in range(kept_groups):
            _, g_best = _first_max(group_score, g_idx, BLOCK_G)
            group_score = tl.where(g_idx[None, :] == g_best[:, None], float("-inf"), group_score)
            expert_kept |= group[None, :] == g_best[:, None]
        choice = tl.where(expert_kept, choice, float("-inf"))

    k_idx = tl.arange(0, BLOCK_K)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        _, pick = _first_max(choice, e, BLOCK_E)
        chosen = e[None, :] == pick[:, None]
        weight = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        choice = tl.where(chosen, float("-inf"), choice)
        top_ids = tl.where(k_idx[None, :] == j, pick[:, None], top_ids)
        top_w = tl.where(k_idx[None, :] == j, weight[:, None], top_w)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    dst = t.to(tl.int64)[:, None] * TOP_K + k_idx[None, :]
    mask = t_ok[:, None] & (k_idx < TOP_K)[None, :]
    tl.store(weights_ptr + dst, top_w * scaling, mask=mask)
    tl.store(ids_ptr + dst, top_ids, mask=mask)


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
    """router_logits: [T, E] float32; correction_bias: [E] float32 (noaux_tc only). Returns
    ``(weights [T, k] float32, expert_ids [T, k] int32)``, in order of selection."""
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    if topk_method == "noaux_tc":
        if correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs correction_bias (e_score_correction_bias)")
        group_score = _TOP2_SUM
    elif topk_method == "group_limited_greedy":
        group_score = _BEST
    elif topk_method == "greedy":
        group_score = _NO_GROUPS
    else:
        raise ValueError(
            f"topk_method must be 'noaux_tc', 'greedy' or 'group_limited_greedy', got {topk_method!r}"
        )
    tokens, experts = router_logits.shape
    if group_score != _NO_GROUPS and experts % n_group:
        raise ValueError(f"{experts} experts cannot be split into {n_group} groups")
    if topk_group >= n_group:
        group_score = _NO_GROUPS  # every group is kept
    use_bias = topk_method == "noaux_tc"
    check_device(router_logits, *([correction_bias] if use_bias else []))
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    block_e = pow2(experts)
    block_t = max(1, min(16, 4096 // block_e))
    if tokens:
        _route_kernel[(triton.cdiv(tokens, block_t),)](
            logits,
            correction_bias if use_bias else logits,
            weights,
            ids,
            tokens,
            experts,
            logits.stride(0),
            n_group,
            topk_group,
            routed_scaling_factor,
            TOP_K=top_k,
            SOFTMAX=scoring_func == "softmax",
            HAS_BIAS=use_bias,
            GROUP_SCORE=group_score,
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_G=pow2(n_group),
            BLOCK_K=pow2(top_k),
            num_warps=4,
        )
    return weights, ids
