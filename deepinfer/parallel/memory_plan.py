"""Per-rank memory of a DeepSeek-family model under expert parallelism, against each chip's HBM.

``plan_memory`` is what ``deepinfer plan memory`` prints and what the simulator calls. Weights are
counted exactly: the real model class is built on the ``meta`` device with the rank's expert shard
(attention, dense layers, shared experts, embeddings and heads replicated; routed experts divided over
the EP ranks plus redundant slots). Weight formats: ``bf16`` (every parameter 2 bytes: what a backend
that dequantises serves) or ``fp8`` (DeepSeek's checkpoint format: linear weights e4m3, 1 byte, plus a
float32 scale per 128x128 block; embeddings, heads, router and norms bf16).

The KV cache is MLA's latent: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer (main and
MTP layers). Activations are an estimate of the largest live tensors of one step of
``max_num_batched_tokens`` tokens on a rank (expanded-MLA q/k/v of a prefill chunk, the MoE pairs a
rank computes when routing is balanced, and the logits of ``max_num_seqs`` rows), not a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.parallel.placement import ExpertShard, moe_layers
from deepinfer.platform.chips import CHIPS

WeightFormat = Literal["bf16", "fp8"]
GIB = 2**30
_BF16_ONLY = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.", "norm", "e_score_correction_bias")


@dataclass(frozen=True, slots=True)
class ChipFit:
    chip: str
    hbm_bytes: int
    free_for_kv_bytes: int  # HBM * utilisation - weights - activations (negative: does not fit)
    kv_tokens: int  # KV-cache tokens the rest holds (0 when it does not fit)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    ep: int
    weight_format: str
    num_redundant_experts: int
    experts_per_rank: int  # physical slots per MoE layer on a rank
    expert_weight_bytes: int  # routed experts on one rank
    replicated_weight_bytes: int  # everything else (same on every rank)
    activation_bytes: int
    kv_bytes_per_token: int
    chips: list[ChipFit]

    @property
    def weight_bytes(self) -> int:
        return self.expert_weight_bytes + self.replicated_weight_bytes


def _param_bytes(name: str, param: torch.Tensor, fmt: WeightFormat, block: tuple[int, int]) -> int:
    if fmt == "bf16" or param.dim() < 2 or any(s in name for s in _BF16_ONLY):
        return param.numel() * 2
    rows, cols = param.shape[-2:]
    matrices = param.numel() // (rows * cols)
    scales = matrices * math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * 4
    return param.numel() + scales


def plan_memory(
    config: ModelConfig,
    ep: int,
    weight_format: WeightFormat = "fp8",
    num_redundant_experts: int = 0,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    kv_bytes_per_value: int = 2,
    memory_utilization: float = 0.9,
) -> MemoryPlan:
    """One rank's memory at expert-parallel size ``ep`` (see the module docstring)."""
    experts = config.n_routed_experts or 0
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if weight_format not in ("bf16", "fp8"):
        raise ValueError(f"weight_format must be 'bf16' or 'fp8', got {weight_format!r}")
    slots = experts + num_redundant_experts
    if experts and (slots % ep or ep > experts):
        raise ValueError(
            f"{experts} routed experts + num_redundant_experts={num_redundant_experts} do not divide over ep={ep}"
        )
    layers = moe_layers(config)
    shard = None
    if experts:
        phy2log = torch.arange(slots).remainder(experts).expand(len(layers), -1).clone()
        shard = ExpertShard(0, ep, None, experts, slots, layers, phy2log)
    model = DeepseekV3ForCausalLM(config, torch.bfloat16, "meta", shard)
    block = config.fp8_block_size or (128, 128)
    expert_bytes = replicated = 0
    for name, param in model.named_parameters():
        size = _param_bytes(name, param, weight_format, block)
        if ".mlp.experts." in name:
            expert_bytes += size
        else:
            replicated += size

    c, t, act = config, max_num_batched_tokens, 2  # activations in bf16
    heads = c.num_attention_heads
    attention = t * heads * (2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim) * act
    pairs = t * (c.num_experts_per_tok or 0)  # balanced routing: a rank computes its tokens' share
    moe = pairs * (2 * c.hidden_size + 3 * c.moe_intermediate_size) * act + t * c.hidden_size * 4
    hidden = 4 * t * c.hidden_size * act
    logits = max_num_seqs * c.vocab_size * 4
    activations = max(attention, moe) + hidden + logits
    kv_per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * kv_bytes_per_value * model.num_cache_layers

    fits = []
    for key, chip in CHIPS.items():
        if not chip.hbm_bytes:
            continue  # host memory (cpu): no HBM to plan against
        free = int(chip.hbm_bytes * memory_utilization) - expert_bytes - replicated - activations
        fits.append(ChipFit(key, chip.hbm_bytes, free, max(0, free) // kv_per_token))
    return MemoryPlan(
        ep,
        weight_format,
        num_redundant_experts,
        slots // ep if experts else 0,
        expert_bytes,
        replicated,
        activations,
        kv_per_token,
        fits,
    )


def load_config(path: str | Path) -> ModelConfig:
    """A model config from a ``config.json`` file or a model folder holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--model {path}: no config.json there")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def format_plans(plans: list[MemoryPlan]) -> str:
    """A text table: one block per EP size, one row per chip."""
    lines = []
    for p in plans:
        lines.append(
            f"EP {p.ep} ({p.weight_format}, {p.experts_per_rank} expert slots/layer/rank): weights "
            f"{p.weight_bytes / GIB:.1f} GiB (experts {p.expert_weight_bytes / GIB:.1f}, replicated "
            f"{p.replicated_weight_bytes / GIB:.1f}), activations ~{p.activation_bytes / GIB:.1f} GiB, "
            f"KV {p.kv_bytes_per_token / 1024:.1f} KiB/token"
        )
        for f in p.chips:
            verdict = f"{f.kv_tokens:,} KV tokens" if f.free_for_kv_bytes > 0 else "does not fit"
            lines.append(f"    {f.chip:<12} HBM {f.hbm_bytes / 1e9:>6.0f} GB: {verdict}")
    return "\n".join(lines)


def plans_as_json(plans: list[MemoryPlan]) -> str:
    return json.dumps([{**asdict(p), "weight_bytes": p.weight_bytes} for p in plans], indent=2)
