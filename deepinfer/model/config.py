"""The model configuration, parsed and validated from a Hugging Face ``config.json``.

Created by the loader (``ModelConfig.from_dict``), read by every model layer and by the engine (context
length, EOS ids, cache widths). Unsupported values are rejected here, with the key, the value and what
is supported, rather than half-working later.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deepinfer.backends.quant import MX_BLOCK, WeightFormat

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
)


class UnsupportedConfigError(ValueError):
    """A config.json value deepinfer cannot run; the message names the key and the supported values."""


class RopeConfig(BaseModel):
    """Rotary embedding parameters (``rope_parameters`` in transformers 5, ``rope_theta`` +
    ``rope_scaling`` in older and DeepSeek's own configs)."""

    model_config = ConfigDict(frozen=True)

    rope_type: Literal["default", "yarn"] = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


class ModelConfig(BaseModel):
    """A DeepSeek-V3-family architecture (V3, V3.1, R1, V2 and V2-Lite style)."""

    model_config = ConfigDict(frozen=True)

    model_type: Literal["deepseek_v3", "deepseek_v2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    rope: RopeConfig = Field(default_factory=RopeConfig)
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # MoE (n_routed_experts None or 0 means every layer is dense)
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: Literal["sigmoid", "softmax"] = "sigmoid"
    topk_method: Literal["noaux_tc", "greedy", "group_limited_greedy"] = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Multi-token prediction layers stored after the main layers (model.layers.{N..N+k-1}).
    num_nextn_predict_layers: int = 0
    # Hybrid sliding-window attention: per-layer window (None = full attention).
    sliding_window: int | None = None
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # ``quantization_config``: how the checkpoint stores its linear weights (None: not quantised) and
    # its routed experts (the dense format unless ``expert_dtype`` says otherwise, e.g. V4's mxfp4).
    weight_format: WeightFormat | None = None
    expert_weight_format: WeightFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise UnsupportedConfigError(
                    f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}"
                )
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise UnsupportedConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in topk_group="
                    f"{self.topk_group} groups of {per_group}"
                )
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise UnsupportedConfigError("topk_method 'noaux_tc' needs at least 2 experts per group")
        fmt = self.expert_weight_format
        if self.n_routed_experts and fmt is not None and fmt.kind == "mxfp4":
            for key in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, key) % MX_BLOCK:
                    raise UnsupportedConfigError(
                        f"quantization_config.expert_dtype='fp4' needs {key} a multiple of {MX_BLOCK} "
                        f"(one e8m0 scale per {MX_BLOCK} columns), got {getattr(self, key)}"
                    )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedConfigError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UnsupportedConfigError("layer_types lists sliding_attention but sliding_window is not set")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """True for a DeepSeekMoE layer (MTP layers, numbered after the main ones, follow the same rule)."""
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a main layer; MTP layers use full attention."""
        if layer >= self.num_hidden_layers or self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek does)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope
        if rope.rope_type == "yarn" and rope.mscale_all_dim:
            m = yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale *= m * m
        return scale

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict, rejecting what deepinfer cannot run with a clear message."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"config.json: model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _require_value(raw, "hidden_act", ("silu",), default="silu")
        _require_value(raw, "moe_layer_freq", (1,), default=1)
        if raw.get("mlp_bias"):
            raise UnsupportedConfigError("config.json: mlp_bias=True is not supported; supported: false")
        is_v3 = model_type == "deepseek_v3"
        routed = raw.get("n_routed_experts") or None
        eos = raw.get("eos_token_id")
        formats = parse_quantization(raw.get("quantization_config"))
        q_lora = raw.get("q_lora_rank") or None
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise UnsupportedConfigError(f"config.json is missing required keys: {', '.join(missing)}")
        try:
            return cls._build(raw, model_type, is_v3, q_lora, routed, eos, formats)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()
            )
            raise UnsupportedConfigError(f"config.json: {problems}") from None

    @classmethod
    def _build(
        cls,
        raw: dict[str, Any],
        model_type: str,
        is_v3: bool,
        q_lora: int | None,
        routed: int | None,
        eos: Any,
        formats: tuple[WeightFormat | None, WeightFormat | None],
    ) -> ModelConfig:
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            q_lora_rank=q_lora,
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            rope_interleave=raw.get("rope_interleave", True) if is_v3 else True,
            rope=_parse_rope(raw),
            max_position_embeddings=raw["max_position_embeddings"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            attention_bias=raw.get("attention_bias", False),
            n_routed_experts=routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            scoring_func=raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
            topk_method=raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0,
            sliding_window=raw.get("sliding_window"),
            layer_types=tuple(raw["layer_types"]) if raw.get("layer_types") else None,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            weight_format=formats[0],
            expert_weight_format=formats[1],
        )


def parse_quantization(quant: Any) -> tuple[WeightFormat | None, WeightFormat | None]:
    """``quantization_config`` -> (dense weight format, routed-expert weight format); (None, None)
    when the checkpoint is not quantised.

    Accepted: ``quant_method`` "fp8", ``fmt`` "e4m3", ``activation_scheme`` "dynamic" (activations are
    quantised on the fly, never from stored scales), ``weight_block_size`` [bn, bk] (any positive
    pair: [128, 128] for V3 to V4, [32, 32] for V4.1), ``scale_fmt`` absent/null (float32 scales) or
    "ue8m0" (power-of-two scales; activations' scales rounded up to powers of two too), ``expert_dtype``
    absent/null/"fp8" (experts as the dense weights) or "fp4" (MXFP4 experts: e2m1, one e8m0 scale per
    1x32). Anything else is an ``UnsupportedConfigError`` naming the field and the accepted values.
    """
    if not quant:
        return None, None
    if not isinstance(quant, dict):
        raise UnsupportedConfigError(f"config.json: quantization_config must be an object, got {quant!r}")

    def bad(key: str, accepted: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(
            f"config.json: quantization_config.{key}={quant.get(key)!r} is not supported; supported: {accepted}"
        )

    if quant.get("quant_method") != "fp8":
        raise bad("quant_method", "fp8 (DeepSeek's block-scaled FP8)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise bad("fmt", "e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise bad("activation_scheme", "dynamic")
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise bad("weight_block_size", "two positive integers [bn, bk], e.g. [128, 128] or [32, 32]")
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise bad("scale_fmt", "null (float32 scales) or 'ue8m0'")
    dense = WeightFormat("fp8", (block[0], block[1]), "ue8m0" if scale_fmt else "f32")
    expert_dtype = quant.get("expert_dtype")
    if expert_dtype in (None, "fp8"):
        return dense, dense
    if expert_dtype == "fp4":
        return dense, WeightFormat("mxfp4", (1, MX_BLOCK), "ue8m0")
    raise bad("expert_dtype", "null or 'fp8' (experts as the dense weights), 'fp4' (MXFP4 experts)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _require_value(raw: dict[str, Any], key: str, supported: tuple[Any, ...], default: Any) -> None:
    value = raw.get(key, default)
    if value is None:
        return
    if value not in supported:
        raise UnsupportedConfigError(
            f"config.json: {key}={value!r} is not supported; supported: {', '.join(map(repr, supported))}"
        )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "yarn"):
        raise UnsupportedConfigError(
            f"config.json: rope type {rope_type!r} is not supported; supported: 'default', 'yarn'"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or raw["max_position_embeddings"]
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True),
    )
