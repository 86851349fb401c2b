"""DeepSeek expert routing on ``npu_moe_gating_top_k``.

The op (doc, and the CANN aclnnMoeGatingTopK formula it wraps): ``norm = softmax(x)`` (``norm_type=0``)
or ``sigmoid(x)`` (1); selection value ``norm + bias``; with ``group_count > 1`` groups are scored by
their max (``group_select_mode=0``) or the sum of their top two (1) and the best ``k_group`` kept; the
top ``k`` experts of the kept groups are chosen; ``y = norm[chosen]``, divided by ``sum + eps`` for
sigmoid (always) and multiplied by ``routed_scaling_factor``. With ``out_flag=True`` the third output is
``norm`` itself (float32). Interface mapping:

- ``noaux_tc``: group_select_mode 1 with the correction bias; ``greedy``: one group;
  ``group_limited_greedy``: group_select_mode 0, no bias;
- sigmoid + renormalize (DeepSeek-V3) takes ``y`` as is. Every other combination takes the un-biased
  scores of the chosen experts from ``norm`` and renormalises / scales them here, because the op's
  renormalisation is fixed for sigmoid and its ``renorm`` attribute is documented both as "only 0" (torch_npu)
  and as a softmax renormalisation switch (CANN); relying on either reading is avoided.

Limits (doc): at most 2048 experts; experts divisible by ``group_count`` with more than 2 per group;
``align32(E / group_count) * group_count <= 2048``; ``1 <= k_group <= group_count``;
``k <= k_group * E / group_count``; bias in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.npu import torch_npu

MAX_EXPERTS = 2048
NORM_TYPE = {"softmax": 0, "sigmoid": 1}
GROUP_SELECT = {"noaux_tc": 1, "group_limited_greedy": 0, "greedy": 0}


def _check_limits(num_experts: int, top_k: int, groups: int, kept_groups: int) -> None:
    per_group = num_experts // groups
    aligned = -(-per_group // 32) * 32
    problems = [
        (num_experts > MAX_EXPERTS, f"at most {MAX_EXPERTS} experts"),
        (num_experts % groups != 0 or per_group <= 2, "more than 2 experts per group, evenly divided"),
        (aligned * groups > MAX_EXPERTS, "align32(experts per group) * groups <= 2048"),
        (not 1 <= kept_groups <= groups, "1 <= topk_group <= n_group"),
        (not 1 <= top_k <= kept_groups * per_group, "1 <= top_k <= topk_group * experts per group"),
    ]
    broken = [rule for bad, rule in problems if bad]
    if broken:
        raise ValueError(
            f"moe_route: {num_experts} experts, top_k {top_k}, {groups} groups, {kept_groups} kept: "
            f"npu_moe_gating_top_k needs {'; '.join(broken)}"
        )


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
    if scoring_func not in NORM_TYPE:
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    if topk_method not in GROUP_SELECT:
        raise ValueError(
            f"topk_method must be 'noaux_tc', 'greedy' or 'group_limited_greedy', got {topk_method!r}"
        )
    if topk_method == "noaux_tc" and correction_bias is None:
        raise ValueError("topk_method 'noaux_tc' needs correction_bias (e_score_correction_bias)")
    groups, kept = (1, 1) if topk_method == "greedy" else (n_group, topk_group)
    _check_limits(router_logits.shape[1], top_k, groups, kept)
    bias = correction_bias.to(router_logits.dtype) if topk_method == "noaux_tc" else None
    direct = scoring_func == "sigmoid" and renormalize
    weights, expert_ids, scores = torch_npu().npu_moe_gating_top_k(
        router_logits,
        top_k,
        bias=bias,
        k_group=kept,
        group_count=groups,
        group_select_mode=GROUP_SELECT[topk_method],
        renorm=0,
        norm_type=NORM_TYPE[scoring_func],
        out_flag=not direct,
        routed_scaling_factor=routed_scaling_factor,
        eps=1e-20,
    )
    if not direct:
        weights = scores.gather(1, expert_ids.long())
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routed_scaling_factor
    return weights.to(torch.float32), expert_ids
