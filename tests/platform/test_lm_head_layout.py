"""The CPU platform's LM-head layout: float32 heads become D-major (same values), others stay as loaded,
and the engine applies it to the loaded model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.llm import LLM
from deepinfer.platform.cpu import CpuPlatform
from deepinfer.platform.registry import resolve_platform


def test_float32_head_is_d_major_with_the_same_values() -> None:
    platform = resolve_platform("cpu")
    assert isinstance(platform, CpuPlatform)
    weight = torch.randn(300, 24)
    laid = platform.lm_head_layout(weight)
    assert laid.shape == weight.shape and laid.stride() == (1, 300)
    assert torch.equal(laid, weight)
    x = torch.randn(3, 24)
    torch.testing.assert_close(F.linear(x, laid), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_bf16_head_is_kept_as_loaded() -> None:
    weight = torch.randn(300, 24, dtype=torch.bfloat16)
    assert resolve_platform("cpu").lm_head_layout(weight) is weight


def test_engine_lays_out_the_loaded_head(tiny_model: Path) -> None:
    head = LLM(str(tiny_model), num_kv_blocks=16).engine.model.lm_head.weight
    assert head.dtype == torch.float32 and head.stride() == (1, head.shape[0])
