"""Rotary tables: DeepSeek's YaRN (or plain) frequencies folded into one cos/sin table per model."""

from __future__ import annotations

import math

import torch

from deepinfer.model.config import ModelConfig, RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention factor applied to cos and sin)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = rope.theta**exponents
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolation, 1.0
    interpolation = 1.0 / (rope.factor * pos_freqs)
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    if rope.attention_factor is not None:
        factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv_freq, factor


def cos_sin_table(config: ModelConfig, max_positions: int | None = None) -> torch.Tensor:
    """[P, qk_rope_head_dim] float32 rows ``cat(cos(p f) * a, sin(p f) * a)`` for the ``rope`` op."""
    inv_freq, attention_factor = inverse_frequencies(config.rope, config.qk_rope_head_dim)
    positions = torch.arange(max_positions or config.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * attention_factor, angles.sin() * attention_factor), dim=-1)
