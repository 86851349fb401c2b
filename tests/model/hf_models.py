"""Tiny random DeepSeek-V3 checkpoints written by transformers (the peer implementation), and
rewrites of them into DeepSeek's published layout (per-expert tensors, FP8 block scales, shards)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from deepinfer.backends.quant import WeightFormat, dequantize, quantize_weight
from deepinfer.model.layouts import to_published_layout

BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
    qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.1, num_nextn_predict_layers=0,
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip

CONFIGS: dict[str, dict[str, Any]] = {
    "v3_qlora_grouped": {},
    "v2lite_style_no_qlora": dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                  routed_scaling_factor=1.0, first_k_dense_replace=1),
    "yarn_scaled": dict(max_position_embeddings=1024, rope_scaling=dict(type="yarn", factor=4.0,
                        original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                        beta_slow=1)),
    "rotate_half_unnormalised": dict(rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=1.7),
}  # fmt: skip


def make_hf_checkpoint(path: Path, seed: int = 0, **overrides: Any):
    """Save a random ``DeepseekV3ForCausalLM`` to ``path``; returns the (float32, eval) model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**BASE, **overrides})
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.05)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(scoring_func="sigmoid", topk_method="noaux_tc")
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return model


def write_fused_layout(model, config_dir: Path, dst: Path) -> None:
    """The model in transformers 5's in-memory layout (``mlp.experts.gate_up_proj`` stacked
    [E, 2I, D]); ``save_pretrained`` itself converts back to per-expert tensors on disk."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file(_state(model), dst / "model.safetensors")
    (dst / "config.json").write_text((config_dir / "config.json").read_text())


def _state(model) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k
    }


FP8_SKIP = ("embed_tokens", "norm", "lm_head", "mlp.gate.", "layernorm", "e_score_correction_bias")


def rewrite_deepseek_layout(
    model, config_dir: Path, dst: Path, fp8: bool, shards: int = 2, block: int = 32
) -> None:
    """Write the model in DeepSeek's published layout: experts split per expert
    (``mlp.experts.{e}.gate_proj.weight`` ...), optionally FP8 e4m3 linear weights with block scales
    (``weight_scale_inv``; a small block so that the tiny matrices have several), in ``shards`` files
    with a ``model.safetensors.index.json``."""
    dst.mkdir(parents=True, exist_ok=True)
    out = to_published_layout(_state(model))
    if fp8:
        for name in [n for n in out if n.endswith(".weight") and out[n].dim() == 2]:
            if any(s in name for s in FP8_SKIP):
                continue
            q, scale = quantize_weight(out[name], WeightFormat("fp8", (block, block)))
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
    names = sorted(out)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: out[n].contiguous() for n in part}, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = json.loads((config_dir / "config.json").read_text())
    if fp8:
        raw["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block], "activation_scheme": "dynamic"
        }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(raw, indent=2))


def dequantized_copy(fp8_dir: Path, dst: Path) -> None:
    """The FP8 checkpoint's own dequantised reference: same tensors, FP8 weights * scales in float32."""
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((fp8_dir / "config.json").read_text())
    block = tuple(raw.pop("quantization_config")["weight_block_size"])
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(fp8_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale_inv")
        out[name] = dequantize(t, scale, WeightFormat("fp8", block)) if scale is not None else t
    save_file(out, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(raw, indent=2))


def add_mtp_weights(model, src: Path, dst: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model in fused layout plus one MTP layer (model.layers.N.*) with random weights."""
    write_fused_layout(model, src, dst)
    tensors = load_file(dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    n, d = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    mtp: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{n - 1}."):
            mtp[name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = t + 0.02 * torch.randn(
                t.shape, generator=gen
            )
    mtp[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{n}.enorm.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
    mtp[f"model.layers.{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
    mtp[f"model.layers.{n}.eh_proj.weight"] = 0.1 * torch.randn(d, 2 * d, generator=gen)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, dst / "model.safetensors")
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return mtp
