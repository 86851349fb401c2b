"""Quantised checkpoints of tiny random DeepSeek-V3 models, written as DeepSeek ships them: FP8 e4m3
linear weights with block scales (``weight_scale_inv``: float32, or float8_e8m0fnu for ue8m0
checkpoints), optionally V4-style MXFP4 routed experts (int8 [N, K / 2] values, float8_e8m0fnu
scales per 1x32), in the per-expert layout or transformers 5's fused one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.backends.quant import WeightFormat, quantize_weight
from deepinfer.model.layouts import to_fused_layout, to_published_layout
from tests.model.hf_models import make_hf_checkpoint

# Stays high precision in DeepSeek's checkpoints.
HIGH_PRECISION = ("embed_tokens", "norm", "lm_head", "mlp.gate.", "layernorm", "e_score_correction_bias")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name and ".shared_experts." not in name


def write_quantised(
    src,
    config_dir: Path,
    dst: Path,
    block: int | tuple[int, int],
    scale_fmt: str | None = None,
    expert_dtype: str | None = None,
    fused: bool = False,
    edit: Any = None,
) -> Path:
    """Write ``src`` (a transformers model, or a state dict in either expert layout) quantised into
    ``dst`` (config.json from ``config_dir``): every 2-D linear weight as
    FP8 with ``block`` scales (``scale_fmt`` None: float32 scales; "ue8m0": power-of-two scales stored
    as float8_e8m0fnu), routed experts as MXFP4 when ``expert_dtype == "fp4"``; ``fused``: experts in
    the fused layout (``gate_up_proj`` [E, 2I, D] with ``gate_up_proj_scale_inv``). ``edit(tensors,
    config)`` may change both before they are written (for error tests)."""
    bn, bk = (block, block) if isinstance(block, int) else block
    dense = WeightFormat("fp8", (bn, bk), "ue8m0" if scale_fmt else "f32")
    experts_fmt = WeightFormat("mxfp4", (1, 32), "ue8m0") if expert_dtype == "fp4" else dense
    items = src.items() if isinstance(src, dict) else src.state_dict().items()
    state = to_published_layout({k: v.detach().float().clone() for k, v in items if "rotary_emb" not in k})
    tensors = to_fused_layout(state) if fused else state
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        fused_experts = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        linear = name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in HIGH_PRECISION)
        if not (linear or fused_experts):
            out[name] = t
            continue
        fmt = experts_fmt if _is_expert(name) else dense
        values, scale = quantize_weight(t, fmt)
        out[name], out[name + "_scale_inv"] = _as_shipped(values, scale, fmt)
    raw = json.loads((config_dir / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk],
        **({"scale_fmt": scale_fmt} if scale_fmt else {}), **({"expert_dtype": expert_dtype} if expert_dtype else {}),
    }  # fmt: skip
    if edit is not None:
        edit(out, raw)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in out.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def _as_shipped(
    values: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our in-memory layout -> the checkpoint's dtypes (int8 e2m1 pairs; e8m0 scales)."""
    if fmt.kind == "mxfp4":
        return values.view(torch.int8), scale.view(torch.float8_e8m0fnu)
    if fmt.scale_fmt == "ue8m0":
        return values, scale.to(torch.float8_e8m0fnu)
    return values, scale


def tiny_quantisable_model(path: Path, seed: int = 0, **overrides: Any):
    """A random V3 whose dimensions are not multiples of the blocks (hidden 224 = 7 x 32, attention
    widths 72/48/..., dense intermediate 100) except where MXFP4 needs 32 (hidden, expert width 64)."""
    config = dict(
        vocab_size=256, hidden_size=224, intermediate_size=100, moe_intermediate_size=64, num_hidden_layers=3,
        kv_lora_rank=48, q_lora_rank=72, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=20,
    )  # fmt: skip
    return make_hf_checkpoint(path, seed, **{**config, **overrides})
