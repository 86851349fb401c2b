"""DeepSeekMoE: routed experts (group-limited top-k gating) plus always-on shared experts.

Without expert parallelism every routed expert is local and ``fused_moe`` computes them. With it (an
``ExpertShard``), this rank holds only its physical slots: routing is computed locally, each (token,
expert) pair is mapped to one replica of its expert (deterministically: replica ``(t * k + j) mod
replicas`` for pair j of token t), sent to the rank owning that slot with ``ep_dispatch``, computed
there and brought back with ``ep_combine``. The shared expert is replicated (computed locally).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.backends.quant import WeightFormat
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import MLP, empty_param
from deepinfer.model.weight_plan import WeightPlan

if TYPE_CHECKING:
    from deepinfer.parallel.placement import ExpertShard


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
    """Routed expert weights, stacked: w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I]; under
    expert parallelism E is this rank's slot count and slot s holds ``shard.local_experts(layer)[s]``.

    With a ``fmt`` they stay quantised (``deepinfer.backends.quant`` layouts): w13 / w2 hold the
    values (float8_e4m3fn, or uint8 [.., K / 2] for mxfp4) and w13_scale [E, *fmt.scale_shape(2I, D)]
    / w2_scale [E, *fmt.scale_shape(D, I)] the checkpoint's ``weight_scale_inv`` (float32 for fp8,
    uint8 e8m0 exponents for mxfp4); ``ops.fused_moe_quant`` computes them.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        slots: int | None = None,
        fmt: WeightFormat | None = None,
    ) -> None:
        super().__init__()
        e = (config.n_routed_experts or 0) if slots is None else slots
        i, d = config.moe_intermediate_size, config.hidden_size
        self.fmt = fmt
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        if fmt is None:
            self.w13 = empty_param(e, 2 * i, d, dtype=dtype, device=device)
            self.w2 = empty_param(e, d, i, dtype=dtype, device=device)
            return
        vd, sd = fmt.values_dtype, fmt.scale_dtype
        self.w13 = empty_param(e, *fmt.values_shape(2 * i, d), dtype=vd, device=device)
        self.w13_scale = empty_param(e, *fmt.scale_shape(2 * i, d), dtype=sd, device=device)
        self.w2 = empty_param(e, *fmt.values_shape(d, i), dtype=vd, device=device)
        self.w2_scale = empty_param(e, *fmt.scale_shape(d, i), dtype=sd, device=device)

    def slot_tensors(self) -> tuple[nn.Parameter, ...]:
        """Every parameter indexed by slot on its first dimension (what moving an expert moves)."""
        extra = () if self.fmt is None else (self.w13_scale, self.w2_scale)
        return (self.w13, self.w2, *extra)  # type: ignore[return-value]

    def slot_bytes(self) -> int:
        """Bytes one slot's weights take as held (values plus scales)."""
        return sum(t[0].numel() * t.element_size() for t in self.slot_tensors())

    def forward(self, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """``fused_moe`` over these experts (``fused_moe_quant`` when they are quantised)."""
        if self.fmt is None:
            return ops.fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids)
        return ops.fused_moe_quant(
            hidden, self.w13, self.w13_scale, self.w2, self.w2_scale, self.fmt, topk_weights, topk_ids
        )


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        layer: int = 0,
        shard: ExpertShard | None = None,
        plan: WeightPlan | None = None,
        fused_experts: bool = False,
    ) -> None:
        """``plan``: what stays quantised (None: everything in ``dtype``); ``fused_experts``: the
        checkpoint stores this layer's experts fused (transformers 5 layout), not per expert."""
        super().__init__()
        c = config
        self.layer, self.shard = layer, shard
        self.num_experts = c.n_routed_experts or 0
        self.gate = Router(c, device)
        fmt = None if plan is None else plan.expert_format(layer, c.moe_intermediate_size, fused_experts)
        self.experts = Experts(c, dtype, device, None if shard is None else shard.slots_per_rank, fmt)
        # Set by the data-parallel rank: expert-load recorder (EPLB) and the debug collective trace.
        self.load_recorder: Any | None = None
        self.trace: list[str] | None = None
        if shard is not None:
            self.set_placement(*shard.log2phy(layer))
        self.shared_experts = (
            MLP(
                c.hidden_size,
                c.moe_intermediate_size * c.n_shared_experts,
                dtype,
                device,
                plan,
                f"model.layers.{layer}.mlp.shared_experts.",
            )
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

    def set_placement(self, log2phy: Tensor, logcnt: Tensor) -> None:
        """This layer's replica table: log2phy [E, R] physical slots per logical expert (-1 padded),
        logcnt [E] replica counts. Host tensors; kept on the weights' device."""
        device = self.experts.w13.device
        self.log2phy, self.logcnt = log2phy.to(device), logcnt.to(device)

    def physical_ids(self, ids: Tensor) -> Tensor:
        """[T, k] logical expert ids -> [T, k] physical slots, replica ``(t * k + j) mod count``."""
        ids = ids.long()
        pair = torch.arange(ids.numel(), device=ids.device).view_as(ids)
        replica = pair % self.logcnt[ids]
        return self.log2phy[ids, replica]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:  # a zero-token forward (an idle data-parallel rank): collectives only
            weights = torch.empty(0, self.top_k, dtype=torch.float32, device=x.device)
            ids = torch.empty(0, self.top_k, dtype=torch.int32, device=x.device)
        else:
            weights, ids = self._route(x)
        if self.load_recorder is not None:
            self.load_recorder.record(self.layer, ids)
        out = self._routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        if self.shard is None:
            return self.experts(x, weights, ids)
        group = self.shard.group
        if self.trace is not None:
            self.trace.append(f"ep_dispatch+combine:{self.layer}")
        sent = ops.ep_dispatch(x, self.physical_ids(ids), weights, self.shard.num_slots, group)
        received = sent.hidden.shape[0]
        if self.load_recorder is not None:
            self.load_recorder.record_received(self.layer, received)
        local = self.experts(
            sent.hidden,
            torch.ones(received, 1, dtype=torch.float32, device=x.device),  # ep_combine applies weights
            sent.local_expert_ids[:, None],
        )
        return ops.ep_combine(local, sent, group)

    def _route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return ops.moe_route(
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
