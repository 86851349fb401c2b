"""Emulated MoE ops, from their documentation (torch_npu 2.13.0; CANN aclnn formulas where the torch_npu
text gives none):

- ``npu_moe_gating_top_k``: x [T, E] (E <= 2048); bias [E] in x's dtype; norm = softmax (norm_type 0) or
  sigmoid (1); groups only when group_count > 1, scored by max (mode 0) or top-2 sum (mode 1); E divisible
  by group_count with more than 2 experts per group, align32(E / group_count) * group_count <= 2048;
  1 <= k_group <= group_count; 1 <= k <= k_group * E / group_count; renorm only 0. y = norm of the chosen
  experts (un-biased), divided by (sum + eps) for sigmoid, times routed_scaling_factor; y in x's dtype,
  ids int32; the third output is norm (float32) only with out_flag (emulated as NaN otherwise).
- ``npu_moe_init_routing_v2``: dropless (drop_pad_mode 0), expert_tokens_num_type 1 (counts) with
  expert_tokens_num_flag True, quant_mode -1, row_idx_type 0 (gather index: per (token, k) pair its row in
  expanded_x, -1 when outside active_expert_range); expert ids in [0, expert_num); rows of expanded_x past
  the active pairs are unspecified (NaN here).
- ``npu_grouped_matmul``: one x [M, K], one 3-D weight [E, K, N] (contiguous or a transposed view),
  split_item 2/3, group_type 0, group_list int64 [E] (E <= 1024), cumulative (type 0) or counts (type 1).
  The doc asks the groups to cover all M rows; vllm-ascend's all-gather EP path relies on covering fewer
  (rows past the groups are not written), so a sum <= M is accepted and the rest is left NaN.
- ``npu_moe_token_unpermute``: permuted [T*K, H], sorted_indices int32 [T*K], a permutation of [0, T*K)
  (no -1, no duplicates), probs [T, K]; out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]].
"""

from __future__ import annotations

import torch
from torch import Tensor

from tests.ascend.emulation.runtime import npu_op


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise RuntimeError(f"{op}: {message}")


@npu_op
def npu_moe_gating_top_k(
    x: Tensor,
    k: int,
    *,
    bias: Tensor | None = None,
    input_ids: Tensor | None = None,
    tid2eid: Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[Tensor, Tensor, Tensor]:
    op = "npu_moe_gating_top_k"
    _require(input_ids is None and tid2eid is None, op, "hash routing is not emulated")
    _require(
        x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
        op,
        "x is a 2-D float tensor",
    )
    tokens, experts = x.shape
    _require(
        bias is None or (bias.shape == (experts,) and bias.dtype == x.dtype), op, "bias is [E] in x's dtype"
    )
    per_group = experts // max(group_count, 1)
    _require(experts <= 2048, op, "at most 2048 experts")
    _require(
        group_count > 0 and experts % group_count == 0 and per_group > 2, op, "E / group_count > 2, exact"
    )
    _require(
        -(-per_group // 32) * 32 * group_count <= 2048, op, "align32(E / group_count) * group_count <= 2048"
    )
    _require(1 <= k_group <= group_count and 1 <= k <= k_group * per_group, op, "k_group / k out of range")
    _require(
        renorm == 0 and norm_type in (0, 1) and group_select_mode in (0, 1),
        op,
        "renorm 0, norm 0/1, mode 0/1",
    )
    norm = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    choice = norm + bias.float() if bias is not None else norm
    if group_count > 1:
        grouped = choice.view(tokens, group_count, per_group)
        score = grouped.max(-1).values if group_select_mode == 0 else grouped.topk(2, -1).values.sum(-1)
        kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(k_group, -1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, 1), float("-inf"))
    ids = choice.topk(k, -1).indices
    y = norm.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = (y * routed_scaling_factor).to(x.dtype)
    norm_out = norm if out_flag else torch.full_like(norm, float("nan"))
    return y, ids.to(torch.int32), norm_out


@npu_op
def npu_moe_init_routing_v2(
    x: Tensor,
    expert_idx: Tensor,
    *,
    scale: Tensor | None = None,
    offset: Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] | None = None,
    row_idx_type: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "npu_moe_init_routing_v2"
    _require(
        scale is None and offset is None and quant_mode == -1, op, "only the unquantised mode is emulated"
    )
    _require(
        x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0],
        op,
        "x [T, H], ids [T, K]",
    )
    _require(expert_idx.dtype == torch.int32, op, "expert_idx is int32")
    _require(0 < expert_num <= 10240, op, f"expert_num in (0, 10240], got {expert_num}")
    _require(drop_pad_mode == 0 and active_num in (-1, 0), op, "dropless over all tokens only")
    _require(
        expert_tokens_num_type == 1 and expert_tokens_num_flag,
        op,
        "only count mode with the flag is emulated",
    )
    _require(row_idx_type == 0, op, "only the gather index (row_idx_type 0) is emulated")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    _require(0 <= start < end <= expert_num, op, f"active_expert_range [{start}, {end}) within expert_num")
    flat = expert_idx.reshape(-1).long()
    _require(bool(((flat >= 0) & (flat < expert_num)).all()), op, "expert ids must lie in [0, expert_num)")
    top_k = expert_idx.shape[1]
    active = (flat >= start) & (flat < end)
    pairs = active.nonzero().flatten()
    order = pairs[torch.argsort(flat[pairs], stable=True)]
    expanded = torch.full((flat.numel(), x.shape[1]), float("nan"), dtype=x.dtype)
    expanded[: order.numel()] = x[order // top_k]
    row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32)
    row_idx[order] = torch.arange(order.numel(), dtype=torch.int32)
    counts = torch.bincount(flat[pairs] - start, minlength=end - start).to(torch.int64)
    return expanded, row_idx, counts, torch.full((flat.numel(),), float("nan"))


@npu_op
def npu_grouped_matmul(
    x: list[Tensor],
    weight: list[Tensor],
    *,
    group_list: Tensor | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    **unsupported: object,
) -> list[Tensor]:
    op = "npu_grouped_matmul"
    _require(
        not any(v is not None and v != 0 for v in unsupported.values()),
        op,
        f"not emulated: {sorted(unsupported)}",
    )
    _require(len(x) == 1 and len(weight) == 1, op, "only single x, single weight is emulated")
    (a,), (w,) = x, weight
    _require(
        split_item in (2, 3) and group_type == 0,
        op,
        "a 3-D weight grouped along M needs split_item 2/3, group_type 0",
    )
    _require(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], op, "x [M, K] and weight [E, K, N]")
    _require(
        w.is_contiguous() or w.transpose(1, 2).is_contiguous(), op, "weight contiguous or a transposed view"
    )
    _require(
        a.dtype == w.dtype and a.dtype in (torch.float16, torch.bfloat16, torch.float32),
        op,
        "one float dtype",
    )
    _require(max(a.shape[1], w.shape[2]) < 65536, op, "inner dimensions below 65536")
    _require(
        group_list is not None and group_list.dtype == torch.int64 and group_list.shape == (w.shape[0],),
        op,
        f"group_list is int64 [{w.shape[0]}]",
    )
    _require(w.shape[0] <= 1024, op, "at most 1024 groups")
    values = group_list.tolist()
    if group_list_type == 1:
        _require(all(v >= 0 for v in values), op, "counts are non-negative")
        ends = torch.tensor(values).cumsum(0).tolist()
    else:
        _require(
            group_list_type == 0 and all(0 <= p <= q for p, q in zip([0, *values], values)),
            op,
            "group_list_type 0 holds non-decreasing cumulative ends",
        )
        ends = values
    _require(
        not ends or ends[-1] <= a.shape[0], op, f"groups cover {ends[-1] if ends else 0} rows of {a.shape[0]}"
    )
    out = torch.full((a.shape[0], w.shape[2]), float("nan"), dtype=a.dtype)
    for e, (s, t) in enumerate(zip([0, *ends], ends)):
        out[s:t] = (a[s:t].float() @ w[e].float()).to(a.dtype)
    return [out]


@npu_op
def npu_moe_token_unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    probs: Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: list[int] | None = None,
) -> Tensor:
    op = "npu_moe_token_unpermute"
    _require(not padded_mode and restore_shape is None, op, "padded_mode False and restore_shape None only")
    _require(
        sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, op, "sorted_indices is int32 1-D"
    )
    top_k = probs.shape[1] if probs is not None else 1
    _require(top_k <= 512, op, "topK <= 512")
    pairs = permuted_tokens.shape[0]
    _require(sorted_indices.numel() == pairs, op, "one index per permuted row")
    _require(
        torch.equal(sorted_indices.long().sort().values, torch.arange(pairs)),
        op,
        "sorted_indices must be a permutation of [0, tokens * topK)",
    )
    gathered = permuted_tokens[sorted_indices.long()].float().view(pairs // top_k, top_k, -1)
    weights = probs.float()[..., None] if probs is not None else torch.ones(1)
    return (gathered * weights).sum(1).to(permuted_tokens.dtype)
