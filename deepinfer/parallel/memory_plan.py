"""Per-rank memory of a DeepSeek-family model under expert parallelism, against each chip's HBM.

``plan_memory`` is what ``deepinfer plan memory`` prints and what the simulator calls. Weights are
counted exactly, in the bytes they are stored in: the real model class is built on the ``meta`` device
with the rank's expert shard (attention, dense layers, shared experts, embeddings and heads replicated;
routed experts divided over the EP ranks plus redundant slots), and each parameter is counted in the
format a ``weights`` choice holds it in:

- ``as-stored`` (default): what the checkpoint's ``quantization_config`` stores, as the engine keeps
  it with ``--weights as-stored``: linear and expert weights as FP8 values (1 byte) plus a float32
  scale per block of the checkpoint's ``weight_block_size``, routed experts as MXFP4 (half a byte plus
  one e8m0 byte per 32) when ``expert_dtype`` is fp4; a checkpoint without ``quantization_config`` is
  held in bf16.
- ``fp8``: DeepSeek's FP8 format (128x128 blocks, float32 scales) whatever the checkpoint stores:
  what an FP8 conversion of a bf16 checkpoint would hold.
- ``bf16`` / ``fp32``: every weight dequantised to that dtype (``--weights bf16|fp32``).

Which weights are quantised follows DeepSeek's checkpoints (``deepinfer.backends.quant`` formats):
the attention projections, dense MLPs, shared and routed experts, in the main and the MTP layers. The
rest (embeddings, heads, norms, the router gate, the MTP ``eh_proj``) is bf16 except under ``fp32``;
``e_score_correction_bias`` is float32 as the model holds it. A merged projection (``gate_up_proj``,
the experts' ``w13``) is counted as its two halves, each with its own scale grid, as stored.

The KV cache is MLA's latent: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer (main and
MTP layers). Activations are an estimate of the largest live tensors of one step of
``max_num_batched_tokens`` tokens on a rank (expanded-MLA q/k/v of a prefill chunk, the MoE pairs a
rank computes when routing is balanced, and the logits of ``max_num_seqs`` rows), not a measurement.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from deepinfer.backends.quant import WeightFormat
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.parallel.placement import ExpertShard, moe_layers
from deepinfer.platform.chips import CHIPS

WeightChoice = Literal["as-stored", "fp8", "bf16", "fp32"]
WEIGHT_CHOICES: tuple[str, ...] = ("as-stored", "fp8", "bf16", "fp32")
DEEPSEEK_FP8 = WeightFormat("fp8", (128, 128), "f32")
GIB = 2**30
# Model parameters DeepSeek's checkpoints store quantised (linear and expert weights); the experts'
# own format may differ (MXFP4). Everything else is high precision.
_QUANTISED = re.compile(
    r"(.*\.)?(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.)?(gate_up_proj|gate_proj|up_proj|down_proj))\.weight"
)
_EXPERTS = re.compile(r"(.*\.)?mlp\.experts\.(w13|w2)")
_MERGED = ("gate_up_proj.weight", "experts.w13")  # two halves [I, D] stored (and scaled) separately


@dataclass(frozen=True, slots=True)
class ChipFit:
    chip: str
    hbm_bytes: int
    free_for_kv_bytes: int  # HBM * utilisation - weights - activations (negative: does not fit)
    kv_tokens: int  # KV-cache tokens the rest holds (0 when it does not fit)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    ep: int
    weight_format: str  # the ``weights`` choice
    formats: str  # how it stores the weights, e.g. "fp8 128x128 f32 (experts mxfp4), rest bf16"
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


def weight_formats(config: ModelConfig, weights: str) -> tuple[WeightFormat | None, WeightFormat | None]:
    """(dense, routed-expert) formats a ``weights`` choice holds ``config``'s weights in; None: high
    precision (bf16, or fp32 under ``"fp32"``)."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    if weights == "as-stored":
        return config.weight_format, config.expert_weight_format
    if weights == "fp8":
        return DEEPSEEK_FP8, DEEPSEEK_FP8
    return None, None


def describe_formats(dense: WeightFormat | None, experts: WeightFormat | None, weights: str) -> str:
    """One line: e.g. ``fp8 128x128 f32 (experts mxfp4), rest bf16`` or ``all bf16``."""
    high = "fp32" if weights == "fp32" else "bf16"
    if dense is None and experts is None:
        return f"all {high}"
    linear = dense.name if dense is not None else high
    expert = "" if experts == dense else f" (experts {experts.name if experts is not None else high})"
    return f"{linear}{expert}, rest {high}"


def param_bytes(
    name: str, param: torch.Tensor, dense: WeightFormat | None, experts: WeightFormat | None, high: int
) -> int:
    """Stored bytes of model parameter ``name`` (shape [..., N, K]): in ``experts`` for the routed
    experts' ``w13``/``w2``, in ``dense`` for the other linear weights, ``high`` bytes per value for
    high-precision floats (float32 parameters, the routing bias, stay 4)."""
    fmt = experts if _EXPERTS.fullmatch(name) else dense if _QUANTISED.fullmatch(name) else None
    if fmt is None or param.dim() < 2:
        return param.numel() * max(high, param.element_size())
    n, k = param.shape[-2:]
    matrices = param.numel() // (n * k)
    if name.endswith(_MERGED):
        return matrices * 2 * fmt.stored_bytes(n // 2, k)
    return matrices * fmt.stored_bytes(n, k)


def plan_memory(
    config: ModelConfig,
    ep: int,
    weight_format: WeightChoice = "as-stored",
    num_redundant_experts: int = 0,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    kv_bytes_per_value: int = 2,
    memory_utilization: float = 0.9,
) -> MemoryPlan:
    """One rank's memory at expert-parallel size ``ep``, weights held as ``weight_format`` says (see
    the module docstring)."""
    experts = config.n_routed_experts or 0
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    dense_fmt, expert_fmt = weight_formats(config, weight_format)
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
    # The high-precision parameter set (one tensor per weight); formats are applied by name below.
    plain = config.model_copy(update={"weight_format": None, "expert_weight_format": None})
    model = DeepseekV3ForCausalLM(plain, torch.bfloat16, "meta", shard)
    high = 4 if weight_format == "fp32" else 2
    expert_bytes = replicated = 0
    for name, param in model.named_parameters():
        size = param_bytes(name, param, dense_fmt, expert_fmt, high)
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
        describe_formats(dense_fmt, expert_fmt, weight_format),
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
            f"EP {p.ep} ({p.formats}, {p.experts_per_rank} expert slots/layer/rank): weights "
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
