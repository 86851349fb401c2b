"""Conformance of the active backend against the reference, op by op (see the package docstring)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import (
    FP8_FORMATS,
    QUANT_FORMATS,
    SMALL_MLA,
    SMALL_MOE,
    V3_MLA,
    Target,
    format_id,
    quant_moe,
    v3_moe,
)

MLA_SHAPES = [SMALL_MLA, V3_MLA]
# (K, N, heads): small, V3's q_a_proj (7168 -> 1536), V3's absorbed W_UK per head (128 -> 512, 128 heads)
LINEAR_DIMS = [(64, 48, 0), (37, 19, 0), (48, 64, 4), (33, 50, 3), (7168, 1536, 0), (128, 512, 128)]


def linear_id(dims: tuple[int, int, int]) -> str:
    k, n, heads = dims
    return f"{'deepseek_v3' if k >= 128 else 'small'}-{k}x{n}x{heads}"


DTYPES = ["float32", "bfloat16", "float16"]


def _dtype(target: Target, name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if dtype not in target.dtypes:
        pytest.skip(f"{name} not in DEEPINFER_CONFORMANCE_DTYPES")
    return dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 7168])
def test_rms_norm(target: Target, dtype: str, hidden: int) -> None:
    checks.check_rms_norm(
        target.ops, target.device, _dtype(target, dtype), hidden, f"rms_norm-{hidden}-{dtype}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", LINEAR_DIMS, ids=linear_id)
def test_linear(target: Target, dtype: str, dims: tuple[int, int, int]) -> None:
    k, n, heads = dims
    case = f"linear-{linear_id(dims)}-{dtype}"
    checks.check_linear(target.ops, target.device, _dtype(target, dtype), k, n, heads, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [32, 2048])
def test_silu_and_mul(target: Target, dtype: str, width: int) -> None:
    checks.check_silu_and_mul(
        target.ops, target.device, _dtype(target, dtype), width, f"silu-{width}-{dtype}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: s.name)
def test_rope(target: Target, dtype: str, interleaved: bool, shape) -> None:
    case = f"rope-{shape.name}-{interleaved}-{dtype}"
    checks.check_rope(target.ops, target.device, _dtype(target, dtype), shape, interleaved, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: s.name)
def test_kv_cache_write_gather(target: Target, dtype: str, shape) -> None:
    checks.check_kv_cache(target.ops, target.device, _dtype(target, dtype), shape, f"kv-{shape.name}-{dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: s.name)
def test_mla_prefill(target: Target, dtype: str, window, shape) -> None:
    case = f"prefill-{shape.name}-{window}-{dtype}"
    checks.check_mla_prefill(target.ops, target.device, _dtype(target, dtype), shape, window, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "context"])
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: s.name)
def test_mla_prefill_partial(target: Target, dtype: str, causal: bool, shape) -> None:
    case = f"prefill-partial-{shape.name}-{causal}-{dtype}"
    checks.check_mla_prefill_partial(target.ops, target.device, _dtype(target, dtype), shape, causal, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 3, 2, 4]], ids=["decode", "multi-query"])
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: s.name)
def test_mla_decode(target: Target, dtype: str, window, query_lens, shape) -> None:
    case = f"decode-{shape.name}-{query_lens}-{window}-{dtype}"
    checks.check_mla_decode(target.ops, target.device, _dtype(target, dtype), shape, query_lens, window, case)


ROUTING = [
    ("sigmoid", "noaux_tc", True),
    ("sigmoid", "noaux_tc", False),
    ("softmax", "greedy", False),
    ("softmax", "group_limited_greedy", True),
]


@pytest.mark.parametrize("routing", ROUTING, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("moe", ["small", "deepseek_v3"])
def test_moe_route(target: Target, routing, moe: str) -> None:
    shape = SMALL_MOE if moe == "small" else v3_moe()
    checks.check_moe_route(target.ops, target.device, shape, *routing, f"route-{moe}-{routing}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moe", ["small", "deepseek_v3"])
def test_grouped_gemm(target: Target, dtype: str, moe: str) -> None:
    shape = SMALL_MOE if moe == "small" else v3_moe()
    checks.check_grouped_gemm(target.ops, target.device, _dtype(target, dtype), shape, f"gg-{moe}-{dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_remote", [False, True], ids=["all-local", "some-remote"])
@pytest.mark.parametrize("moe", ["small", "deepseek_v3"])
def test_fused_moe(target: Target, dtype: str, with_remote: bool, moe: str) -> None:
    shape = SMALL_MOE if moe == "small" else v3_moe()
    case = f"moe-{moe}-{with_remote}-{dtype}"
    checks.check_fused_moe(target.ops, target.device, _dtype(target, dtype), shape, with_remote, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moe", ["small", "deepseek_v3"])
def test_ep_dispatch_combine_single_rank(target: Target, dtype: str, moe: str) -> None:
    shape = SMALL_MOE if moe == "small" else v3_moe()
    checks.check_ep_single_rank(target.ops, target.device, _dtype(target, dtype), shape, f"ep-{moe}-{dtype}")


@pytest.mark.parametrize("case", ["a", "b", "c"])
def test_sample(target: Target, case: str) -> None:
    checks.check_sample(target.ops, target.device, f"sample-{case}")


@pytest.mark.parametrize("vocab", [7, 1000, 129280])
def test_greedy(target: Target, vocab: int) -> None:
    checks.check_greedy(target.ops, target.device, vocab, f"greedy-{vocab}")


def test_apply_token_bitmask(target: Target) -> None:
    checks.check_apply_token_bitmask(target.ops, target.device, "bitmask")


# Quantised weights (issue 29): N and K not multiples of the 128 or 32 blocks, every format; DeepSeek
# widths in the formats that ship at them; 4096 rows once per op (test_quant_ops_at_4096_rows: one
# dtype, small dims, as Triton's interpreter runs a Python loop per program).
# (name, rows, K)
QUANT_GROUP_DIMS = [("small", 13, 200), ("deepseek_v3", 4, 7168)]
# (name, K, N, row counts, formats): scale grids 2x3 (128) and 7x11 (32) with partial last blocks;
# V3's kv_a_proj_with_mqa (7168 -> 576, a partial N block) in V3's and V3.1's 128x128 formats.
QUANT_LINEAR_CASES = [
    *(("small", 328, 200, checks.QUANT_ROWS, f) for f in FP8_FORMATS),
    *(("deepseek_v3", 7168, 576, (5,), f) for f in FP8_FORMATS if f.block == (128, 128)),
]
# (MoE shape, rows or tokens, with_remote, formats): V3 routing in V3.1's FP8 and V4's MXFP4 experts.
QUANT_MOE_CASES = [
    *((shape, rows, remote, f) for shape, rows, remote in (("odd", 1, False), ("odd", 37, False),
      ("odd", 13, True)) for f in QUANT_FORMATS),
    *(("deepseek_v3", 37, False, f) for f in QUANT_FORMATS if format_id(f) in ("fp8-128x128-ue8m0", "mxfp4")),
]  # fmt: skip


def quant_linear_id(case) -> str:
    return f"{case[0]}-{case[1]}x{case[2]}-{format_id(case[4])}"


def quant_moe_id(case) -> str:
    return f"{case[0]}-{case[1]}{'-remote' if case[2] else ''}-{format_id(case[3])}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("dims", QUANT_GROUP_DIMS, ids=lambda d: f"{d[0]}-{d[1]}x{d[2]}")
def test_quant_fp8_group(target: Target, dtype: str, group: int, dims) -> None:
    name, rows, k = dims
    case = f"qgroup-{name}-{rows}x{k}-{group}-{dtype}"
    checks.check_quant_fp8_group(target.ops, target.device, _dtype(target, dtype), rows, k, group, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("linear", QUANT_LINEAR_CASES, ids=quant_linear_id)
def test_fp8_linear(target: Target, dtype: str, linear) -> None:
    _, k, n, rows, fmt = linear
    case = f"fp8_linear-{quant_linear_id(linear)}-{dtype}"
    checks.check_fp8_linear(target.ops, target.device, _dtype(target, dtype), fmt, k, n, rows, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("linear", QUANT_LINEAR_CASES, ids=quant_linear_id)
def test_fp8_linear_w8a8(target: Target, dtype: str, linear) -> None:
    _, k, n, rows, fmt = linear
    case = f"fp8_w8a8-{quant_linear_id(linear)}-{dtype}"
    checks.check_fp8_linear_w8a8(target.ops, target.device, _dtype(target, dtype), fmt, k, n, rows, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moe", [c for c in QUANT_MOE_CASES if not c[2]], ids=quant_moe_id)
def test_grouped_gemm_quant(target: Target, dtype: str, moe) -> None:
    name, rows, _, fmt = moe
    case = f"ggq-{quant_moe_id(moe)}-{dtype}"
    checks.check_grouped_gemm_quant(
        target.ops, target.device, _dtype(target, dtype), fmt, quant_moe(name, fmt), rows, case
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("moe", QUANT_MOE_CASES, ids=quant_moe_id)
def test_fused_moe_quant(target: Target, dtype: str, moe) -> None:
    name, tokens, remote, fmt = moe
    case = f"moeq-{quant_moe_id(moe)}-{dtype}"
    checks.check_fused_moe_quant(
        target.ops, target.device, _dtype(target, dtype), fmt, quant_moe(name, fmt), tokens, remote, case
    )


FORMAT = {format_id(f): f for f in QUANT_FORMATS}


@pytest.mark.parametrize(
    ("op", "fmt_id"),
    [("quant_fp8_group", "ue8m0"), ("fp8_linear", "fp8-128x128-f32"), ("fp8_linear_w8a8", "fp8-32x32-ue8m0"),
     ("grouped_gemm_quant", "mxfp4"), ("fused_moe_quant", "fp8-128x128-ue8m0"), ("fused_moe_quant", "mxfp4")],
    ids=lambda v: v,
)  # fmt: skip
def test_quant_ops_at_4096_rows(target: Target, op: str, fmt_id: str) -> None:
    """4096 rows (tokens) at small dims, in the first dtype under test."""
    ops, device, dtype = target.ops, target.device, target.dtypes[0]
    case = f"q4096-{op}-{fmt_id}-{dtype}"
    if op == "quant_fp8_group":
        checks.check_quant_fp8_group(ops, device, dtype, 4096, 48, 128, case, ue8m0_modes=(True,))
    elif op in ("fp8_linear", "fp8_linear_w8a8"):
        check = checks.check_fp8_linear if op == "fp8_linear" else checks.check_fp8_linear_w8a8
        check(ops, device, dtype, FORMAT[fmt_id], 96, 40, (4096,), case)
    elif op == "grouped_gemm_quant":
        fmt = FORMAT[fmt_id]
        checks.check_grouped_gemm_quant(ops, device, dtype, fmt, quant_moe("rows4096", fmt), 4096, case)
    else:
        fmt = FORMAT[fmt_id]
        checks.check_fused_moe_quant(ops, device, dtype, fmt, quant_moe("rows4096", fmt), 4096, False, case)


def test_every_interface_op_is_covered() -> None:
    """A new interface op must get a conformance check here."""
    from deepinfer.backends.registry import interface_ops

    covered = {
        "rms_norm", "add_rms_norm", "silu_and_mul", "rope", "kv_cache_spec", "kv_cache_write",
        "kv_cache_gather", "mla_prefill", "mla_prefill_partial", "mla_decode", "moe_route", "grouped_gemm", "fused_moe",
        "ep_dispatch", "ep_combine", "sample", "greedy", "apply_token_bitmask", "linear",
        "quant_fp8_group", "fp8_linear", "fp8_linear_w8a8", "grouped_gemm_quant", "fused_moe_quant",
    }  # fmt: skip
    assert set(interface_ops()) == covered
