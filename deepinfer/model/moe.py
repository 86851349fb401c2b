"""DeepSeekMoE: routed experts (group-limited top-k gating) plus always-on shared experts."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import MLP, empty_param


class Router(nn.Module):
    """The gate: router logits in float32 (weight and correction bias are kept in float32)."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        experts = config.n_routed_experts or 0
        self.weight = empty_param(experts, config.hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias = (
            empty_param(experts, dtype=torch.float32, device=device)
            if config.topk_method == "noaux_tc"
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x.float(), self.weight, None)


class Experts(nn.Module):
    """Routed expert weights, stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        e, i, d = config.n_routed_experts or 0, config.moe_intermediate_size, config.hidden_size
        self.w13 = empty_param(e, 2 * i, d, dtype=dtype, device=device)
        self.w2 = empty_param(e, d, i, dtype=dtype, device=device)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.gate = Router(c, device)
        self.experts = Experts(c, dtype, device)
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, dtype, device)
            if c.n_shared_experts
            else None
        )
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.scoring_func, self.topk_method = c.scoring_func, c.topk_method
        if c.model_type == "deepseek_v2":
            # DeepSeek-V2 either renormalises the top-k weights or scales them, never both.
            self.renormalize = c.norm_topk_prob and c.num_experts_per_tok > 1
            self.scaling = 1.0 if self.renormalize else c.routed_scaling_factor
        else:
            self.renormalize, self.scaling = c.norm_topk_prob, c.routed_scaling_factor

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = ops.moe_route(
            self.gate(x),
            self.gate.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.scoring_func,
            self.topk_method,
            self.renormalize,
            self.scaling,
        )
        out = ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
