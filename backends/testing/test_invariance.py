"""Batch invariance of every op as deterministic mode runs it on the backend under test (see
``invariance``): bit-identical rows alone and inside larger, different batches."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.testing import invariance
from deepinfer.backends.testing.harness import (
    QUANT_FORMATS,
    SMALL_MLA,
    SMALL_MOE,
    V3_MLA,
    MoEShape,
    Target,
    format_id,
    v3_moe,
)

# Widths that are not multiples of a vector: rows end inside a vector loop (scalar tails).
ODD_MOE = MoEShape("odd", experts=12, top_k=3, n_group=4, topk_group=2, hidden=40, intermediate=24)

DTYPES = ["float32", "bfloat16", "float16"]


def _dtype(target: Target, name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if dtype not in target.dtypes:
        pytest.skip(f"{name} not in DEEPINFER_CONFORMANCE_DTYPES")
    return dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 64, 7168])  # 40: rows that end inside a vector
def test_rowwise_ops(target: Target, dtype: str, hidden: int) -> None:
    invariance.check_rowwise_small_ops(
        target.ops, target.device, _dtype(target, dtype), hidden, f"inv-rows-{hidden}-{dtype}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SMALL_MLA, V3_MLA], ids=lambda s: s.name)
def test_rope(target: Target, dtype: str, shape) -> None:
    invariance.check_rope(
        target.ops, target.device, _dtype(target, dtype), shape, f"inv-rope-{shape.name}-{dtype}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moe", ["odd", "small", "deepseek_v3"])
def test_moe(target: Target, dtype: str, moe: str) -> None:
    shape = {"odd": ODD_MOE, "small": SMALL_MOE}.get(moe) or v3_moe()
    invariance.check_moe(target.ops, target.device, _dtype(target, dtype), shape, f"inv-moe-{moe}-{dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=format_id)
def test_quant(target: Target, dtype: str, fmt) -> None:
    case = f"inv-quant-{format_id(fmt)}-{dtype}"
    invariance.check_quant(target.ops, target.device, _dtype(target, dtype), fmt, case)


def test_sample_and_mask(target: Target) -> None:
    invariance.check_sample_and_mask(target.ops, target.device, "inv-sample")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", [SMALL_MLA, V3_MLA], ids=lambda s: s.name)
def test_attention(target: Target, dtype: str, window, shape) -> None:
    case = f"inv-attn-{shape.name}-{window}-{dtype}"
    invariance.check_attention(target.ops, target.device, _dtype(target, dtype), shape, window, case)


def test_every_op_declares_how_it_runs_in_deterministic_mode(target: Target) -> None:
    """Activation in deterministic mode would fail on an op that can be neither kept nor routed."""
    from deepinfer.backends.registry import interface_ops

    assert set(target.ops.invariance()) == set(interface_ops())


def test_every_op_has_an_invariance_check() -> None:
    from deepinfer.backends.registry import interface_ops

    checked = {
        "rms_norm", "add_rms_norm", "silu_and_mul", "linear", "rope", "moe_route", "grouped_gemm",
        "fused_moe", "ep_dispatch", "ep_combine", "sample", "greedy", "apply_token_bitmask", "kv_cache_spec",
        "kv_cache_write", "kv_cache_gather", "mla_decode", "mla_prefill", "mla_prefill_partial",
        "quant_fp8_group", "fp8_linear", "fp8_linear_w8a8", "grouped_gemm_quant", "fused_moe_quant",
    }  # fmt: skip
    assert set(interface_ops()) == checked
