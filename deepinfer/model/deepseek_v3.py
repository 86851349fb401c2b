"""The DeepSeek-V3 family model (V3 / V3.1 / R1 / V2 / V2-Lite style configs), with MTP layers.

Module names mirror the Hugging Face checkpoint names (``model.layers.{i}.self_attn.kv_b_proj`` ...),
so the loader maps tensors by name; the differences (merged gate/up projections, stacked experts, MTP
layers stored as ``model.layers.{N + j}``) are spelled out in ``checkpoint_targets``.

The model computes one engine step: a flat batch of tokens from many requests (decode tokens first,
then prefill chunks; see ``AttentionMetadata``) with the paged KV cache passed in per layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.model.attention import MLAAttention
from deepinfer.model.attn_metadata import AttentionMetadata
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers import MLP, Linear, RMSNorm, empty_param, linear
from deepinfer.model.moe import MoE
from deepinfer.model.rope import cos_sin_table
from deepinfer.model.weight_plan import SCALE_SUFFIX, WeightPlan

if TYPE_CHECKING:
    from deepinfer.parallel.placement import ExpertShard

KVCache = Sequence[Sequence[Tensor]]  # per cache layer (main layers, then MTP layers): backend tensors


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ExpertShard | None = None,
        plan: WeightPlan | None = None,
        fused_experts: bool = False,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = MLAAttention(config, layer, dtype, device, plan)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp: nn.Module = (
            MoE(config, dtype, device, layer, shard, plan, fused_experts)
            if config.is_moe_layer(layer)
            else MLP(
                config.hidden_size,
                config.intermediate_size,
                dtype,
                device,
                plan,
                f"model.layers.{layer}.mlp.",
            )
        )

    def forward(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_cache: Sequence[Tensor],
        cos_sin: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Returns ``(mlp_out, residual)``; the layer's output is their sum (fused into the next norm)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, positions, meta, kv_cache, cos_sin)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)


class MTPLayer(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3 §2.2): from the main model's final (normed)
    hidden state of token i and the embedding of token i+1, predicts token i+2."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ExpertShard | None = None,
        plan: WeightPlan | None = None,
        fused_experts: bool = False,
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = empty_param(config.vocab_size, d, dtype=dtype, device=device)
        self.enorm = RMSNorm(d, eps, dtype, device)
        self.hnorm = RMSNorm(d, eps, dtype, device)
        quant = None if plan is None else plan.linear(f"model.layers.{layer}.eh_proj.weight")
        self.eh_proj = linear(2 * d, d, False, dtype, device, quant)
        self.block = DecoderLayer(config, layer, dtype, device, shard, plan, fused_experts)
        self.shared_head = SharedHead(config, dtype, device)


@dataclass(slots=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, optionally an index into it (expert, row range),
    optionally from only part of the tensor (``source``: an index into the checkpoint tensor, read as a
    slice so the rest is never loaded)."""

    param: str
    index: tuple[int | slice, ...] = ()
    source: tuple[int | slice, ...] = ()


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        shard: ExpertShard | None = None,
        plan: WeightPlan | None = None,
        fused_experts: frozenset[int] = frozenset(),
    ) -> None:
        """``shard``: this rank's expert placement under expert parallelism (None: every expert local);
        ``plan``: which quantised checkpoint weights stay quantised (None: every weight in ``dtype``);
        ``fused_experts``: layers whose experts the checkpoint stores fused (transformers 5 layout)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.shard = shard
        self.weight_plan = plan
        c = config
        self.embed_tokens = empty_param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, dtype, device, shard, plan, i in fused_experts)
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = (
            None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, False, dtype, device)
        )
        self.mtp_layers = nn.ModuleList(
            MTPLayer(
                c,
                c.num_hidden_layers + j,
                dtype,
                device,
                shard,
                plan,
                c.num_hidden_layers + j in fused_experts,
            )
            for j in range(c.num_nextn_predict_layers)
        )
        self.register_buffer("cos_sin", cos_sin_table(c).to(device), persistent=False)

    # ------------------------------------------------------------------ forward
    @property
    def num_cache_layers(self) -> int:
        """KV-cache layers the engine must allocate: one per main layer and one per MTP layer."""
        return len(self.layers) + len(self.mtp_layers)

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: KVCache
    ) -> Tensor:
        """input_ids, positions: [T]. Returns the final normed hidden states [T, D]."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, meta, cache, self.cos_sin)
        hidden, _ = self.norm.add_forward(hidden, residual)
        return hidden

    def idle_forward(self) -> None:
        """A zero-token forward: every main-layer MoE joins its expert-parallel collectives with no
        tokens of its own, as a data-parallel rank with nothing scheduled must (lockstep)."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.embed_tokens.device)
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp(empty)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, D] -> [N, V] float32."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        return ops.linear(hidden, weight, None).float()

    def mtp_forward(
        self,
        depth: int,
        input_ids: Tensor,
        positions: Tensor,
        previous_hidden: Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> tuple[Tensor, Tensor]:
        """Run MTP module ``depth`` (0-based). input_ids [T]: token i+1 for each position i;
        positions [T]: position i; previous_hidden [T, D]: the main model's final normed hidden state
        at i (for depth > 0, the previous MTP module's output). Uses the cache layer after the main
        layers. Returns ``(hidden [T, D] for the next depth, logits [T, V] float32)``."""
        mtp = self.mtp_layers[depth]
        embeds = F.embedding(input_ids, mtp.embed_tokens)
        x = mtp.eh_proj(torch.cat((mtp.enorm(embeds), mtp.hnorm(previous_hidden)), dim=-1))
        cache = kv_caches[len(self.layers) + depth]
        hidden, residual = mtp.block(x, None, positions, meta, cache, self.cos_sin)
        hidden = hidden + residual
        logits = ops.linear(mtp.shared_head.norm(hidden), mtp.shared_head.head.weight, None).float()
        return hidden, logits

    # ------------------------------------------------------------------ weights
    def finish_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.finish_loading()

    def checkpoint_targets(self, name: str) -> list[Target] | None:
        """Targets of a checkpoint tensor (DeepSeek's published per-expert layout or transformers 5's
        fused one), or None when the name is not part of this model. A scale (``*_scale_inv``) goes to
        the ``*_scale`` parameter beside its weight's, its rows in block units; ask only for scales of
        weights kept quantised (the loader consumes the others while dequantising)."""
        if name.endswith(SCALE_SUFFIX):
            return self._scale_targets(name)
        c = self.config
        if name == "model.embed_tokens.weight":
            return [Target("embed_tokens")]
        if name == "model.norm.weight":
            return [Target("norm.weight")]
        if name == "lm_head.weight":
            return None if self.lm_head is None else [Target("lm_head.weight")]
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        if layer < c.num_hidden_layers:
            prefix = f"layers.{layer}."
        elif layer < c.num_hidden_layers + c.num_nextn_predict_layers:
            j = layer - c.num_hidden_layers
            if rest == "embed_tokens.weight":
                return [Target(f"mtp_layers.{j}.embed_tokens")]
            if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
                return [Target(f"mtp_layers.{j}.{rest}")]
            prefix = f"mtp_layers.{j}.block."
        else:
            return None
        return self._layer_targets(prefix, rest, layer)

    def _merged(self, module: str) -> bool:
        """Whether the MLP at ``module`` holds gate and up as one ``gate_up_proj`` (else two)."""
        try:
            mlp = self.get_submodule(module)
        except AttributeError:
            return True  # no such MLP: the name is reported as unused by the caller
        return not isinstance(mlp, MLP) or mlp.merged

    def _scale_targets(self, name: str) -> list[Target] | None:
        """Targets of a block-scale tensor: its weight's targets moved to the ``*_scale`` parameter,
        with row ranges in units of the format's block rows (row-aligned by construction)."""
        targets = self.checkpoint_targets(name.removesuffix(SCALE_SUFFIX))
        if targets is None:
            return None
        out = []
        for t in targets:
            owner, _, leaf = t.param.rpartition(".")
            fmt = getattr(self.get_submodule(owner), "fmt", None)
            if fmt is None:
                return None
            param = f"{owner}.weight_scale" if leaf == "weight" else f"{owner}.{leaf}_scale"
            rows = fmt.block[0]
            index = tuple(
                slice(i.start // rows, -(-i.stop // rows)) if isinstance(i, slice) else i for i in t.index
            )
            out.append(Target(param, index, t.source))
        return out

    def _slots_of(self, layer: int, expert: int) -> list[int]:
        """This rank's slots of ``layer`` holding logical ``expert`` (all local without a shard)."""
        if self.shard is None:
            return [expert]
        return [s for s, e in enumerate(self.shard.local_experts(layer)) if e == expert]

    def _layer_targets(self, prefix: str, rest: str, layer: int) -> list[Target] | None:
        c = self.config
        moe = c.is_moe_layer(layer)
        inter = c.moe_intermediate_size if moe else c.intermediate_size
        halves = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
        m = re.fullmatch(r"mlp\.(gate_proj|up_proj)\.weight", rest)
        if m and not moe and self._merged(prefix + "mlp"):
            return [Target(prefix + "mlp.gate_up_proj.weight", (halves[m.group(1)],))]
        shared_inter = c.moe_intermediate_size * c.n_shared_experts
        m = re.fullmatch(r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight", rest)
        if m and moe and self._merged(prefix + "mlp.shared_experts"):
            span = (
                slice(0, shared_inter) if m.group(1) == "gate_proj" else slice(shared_inter, 2 * shared_inter)
            )
            return [Target(prefix + "mlp.shared_experts.gate_up_proj.weight", (span,))]
        m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if m and moe:
            expert, proj = int(m.group(1)), m.group(2)
            slots = self._slots_of(layer, expert)  # [] under expert parallelism: not read at all
            if proj == "down_proj":
                return [Target(prefix + "mlp.experts.w2", (s,)) for s in slots]
            return [Target(prefix + "mlp.experts.w13", (s, halves[proj])) for s in slots]
        fused = {"mlp.experts.gate_up_proj": "w13", "mlp.experts.down_proj": "w2"}
        if rest in fused and moe:
            param = prefix + "mlp.experts." + fused[rest]
            if self.shard is None:
                return [Target(param)]
            return [Target(param, (s,), (e,)) for s, e in enumerate(self.shard.local_experts(layer))]
        return [Target(prefix + rest)]
