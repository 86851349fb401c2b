"""The conformance checks of the quantised ops fail on the bugs block-scaled kernels are prone to
(issue 29's acceptance list), in float32 and in bfloat16, whose looser tolerance must not hide them.

Each bug lives in a small tiled kernel written here the way a real one is (a loop over K blocks,
each block's partial product scaled by its block's scales); ``bug=None`` is the correct kernel, which
must pass the same check. The kernel replaces one op of the reference table (``table_with``), and
the test expects the check to fail naming that op:

- ``scale_after_k_loop``: the K loop accumulates unscaled products and applies one scale per output
  block afterwards (the mean of its K blocks' scales) instead of each K block's own;
- ``next_k_block`` / ``next_n_block``: the scale of the next block along K / along N (off by one);
- ``tail_block``: the partial last K block takes the previous block's scale (a floor instead of a
  ceiling in the block count);
- ``transposed``: the scale grid read with its strides swapped (as if stored [K blocks, N blocks]);
- ``nibble_swap``: MXFP4 bytes decoded high nibble first;
- ``ue8m0_down``: power-of-two activation scales rounded down instead of up.

Also: an output block or scale left unwritten shows up (the checks run over NaN-filled memory), and
the batch-invariance check catches the reference's fast kernels wrongly declared invariant.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from deepinfer.backends import quant
from deepinfer.backends.quant import WeightFormat
from deepinfer.backends.reference import moe
from deepinfer.backends.registry import OpTable, interface_ops
from deepinfer.backends.testing import checks, invariance
from deepinfer.backends.testing.harness import QUANT_FORMATS, format_id, quant_moe
from tests.backends.test_conformance_catches_bugs import table_with

CPU = torch.device("cpu")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
FP8 = {format_id(f): f for f in QUANT_FORMATS if f.kind == "fp8"}
MXFP4 = WeightFormat("mxfp4", (1, 32), "ue8m0")
FP8_FORMATS = pytest.mark.parametrize("fmt", list(FP8.values()), ids=list(FP8))
# The conformance suite's small linear shape: scale grids 2x3 (128 blocks) and 7x11 (32), partial tails.
K, N = 328, 200


def tiled_matmul(
    x: Tensor,
    values: Tensor,
    grid: Tensor,
    block: tuple[int, int],
    bug: str | None,
    x_scale: Tensor | None = None,
) -> Tensor:
    """float32 ``x [T, K] @ (values * scales).T`` -> [T, N], one K block at a time: ``values`` [N, K]
    decoded but unscaled, ``grid`` [R, C] the float32 block scales, ``x_scale`` [T, C] (W8A8) or None."""
    bn, bk = block
    n, k = values.shape
    r, c = grid.shape
    if bug == "transposed":
        grid = grid.contiguous().view(c, r).t()
    elif bug == "next_n_block":
        grid = grid[(torch.arange(r) + 1).clamp(max=r - 1)]
    per_row = grid.repeat_interleave(bn, dim=0)[:n]  # [N, C]: each output row's scale per K block
    out = torch.zeros(x.shape[0], n)
    for kb in range(c):
        cols = slice(kb * bk, min(k, (kb + 1) * bk))
        part = x[:, cols] @ values[:, cols].t()
        if bug == "scale_after_k_loop":
            out += part
            continue
        j = kb
        if bug == "next_k_block":
            j = min(kb + 1, c - 1)
        elif bug == "tail_block":
            j = min(kb, max(k // bk, 1) - 1)
        out += part * per_row[:, j] * (1.0 if x_scale is None else x_scale[:, j : j + 1])
    if bug == "scale_after_k_loop":
        out *= per_row.mean(dim=1)
        if x_scale is not None:
            out *= x_scale.mean(dim=1, keepdim=True)
    return out


def decode(
    values: Tensor, scale: Tensor, fmt: WeightFormat, bug: str | None
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """One [N, K] weight -> (unscaled float32 values, float32 scale grid, block)."""
    if fmt.kind == "fp8":
        return values.float(), scale.float(), fmt.block
    if bug == "nibble_swap":
        values = (values << 4) | (values >> 4)
    return quant.unpack_e2m1(values), quant.e8m0_to_float(scale), fmt.block


def effective_weight(values: Tensor, scale: Tensor, fmt: WeightFormat, bug: str | None) -> Tensor:
    """[..., N, K] float32: the weight the tiled kernel multiplies by (its bugs are linear in x)."""
    flat_v, flat_s = values.reshape(-1, *values.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
    out = []
    for v, s in zip(flat_v, flat_s):
        w, grid, block = decode(v, s, fmt, bug)
        out.append(tiled_matmul(torch.eye(w.shape[1]), w, grid, block, bug).t())
    return torch.stack(out).reshape(*values.shape[:-1], -1)


def fp8_linear_with(bug: str | None) -> Callable:
    def fp8_linear(x, weight, weight_scale, block, bias):
        out = tiled_matmul(x.float(), weight.float(), weight_scale.float(), tuple(block), bug)
        return (out if bias is None else out + bias.float()).to(x.dtype)

    return fp8_linear


def fp8_linear_w8a8_with(bug: str | None) -> Callable:
    def fp8_linear_w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype):
        out = tiled_matmul(x_values.float(), weight.float(), weight_scale.float(), tuple(block), bug, x_scale)
        return (out if bias is None else out + bias.float()).to(out_dtype)

    return fp8_linear_w8a8


def grouped_gemm_quant_with(bug: str | None) -> Callable:
    def grouped_gemm_quant(x, weight, weight_scale, fmt, group_sizes):
        w = effective_weight(weight, weight_scale, fmt, bug)
        return moe.grouped_gemm(x.float(), w, group_sizes).to(x.dtype)

    return grouped_gemm_quant


def fused_moe_quant_with(bug: str | None) -> Callable:
    def fused_moe_quant(hidden, w13, w13_scale, w2, w2_scale, fmt, topk_weights, topk_ids):
        w13_f, w2_f = effective_weight(w13, w13_scale, fmt, bug), effective_weight(w2, w2_scale, fmt, bug)
        return moe.fused_moe(hidden.float(), w13_f, w2_f, topk_weights, topk_ids).to(hidden.dtype)

    return fused_moe_quant


def quant_fp8_group_with(bug: str | None) -> Callable:
    def round_down(s: Tensor) -> Tensor:
        _, exponent = torch.frexp(s)  # s = m * 2**e, m in [0.5, 1): 2**(e-1) <= s
        return torch.ldexp(torch.ones_like(s), exponent - 1)

    def quant_fp8_group(x, group, ue8m0):
        m, k = x.shape
        cols = -(-k // group)
        groups = torch.nn.functional.pad(x.float(), (0, cols * group - k)).view(m, cols, group)
        scale = groups.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
        if ue8m0:
            scale = round_down(scale) if bug == "ue8m0_down" else quant.round_scale_ue8m0(scale)
        values = (groups / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return values.view(m, cols * group)[:, :k].contiguous(), scale

    return quant_fp8_group


LINEAR_BUGS = ["scale_after_k_loop", "next_k_block", "next_n_block", "tail_block", "transposed"]


@DTYPES
@FP8_FORMATS
def test_the_correct_tiled_kernels_pass(fmt: WeightFormat, dtype: torch.dtype) -> None:
    """The kernels below are right without their bug: a failure below is the bug's."""
    rows = checks.QUANT_ROWS
    checks.check_fp8_linear(table_with(fp8_linear_with(None)), CPU, dtype, fmt, K, N, rows, "mut-ok")
    checks.check_fp8_linear_w8a8(
        table_with(fp8_linear_w8a8_with(None)), CPU, dtype, fmt, K, N, rows, "mut-ok"
    )
    shape = quant_moe("odd", fmt)
    checks.check_grouped_gemm_quant(
        table_with(grouped_gemm_quant_with(None)), CPU, dtype, fmt, shape, 37, "ok"
    )
    checks.check_fused_moe_quant(
        table_with(fused_moe_quant_with(None)), CPU, dtype, fmt, shape, 13, True, "ok"
    )


@DTYPES
def test_the_correct_mxfp4_and_group_quant_kernels_pass(dtype: torch.dtype) -> None:
    shape = quant_moe("odd", MXFP4)
    checks.check_grouped_gemm_quant(
        table_with(grouped_gemm_quant_with(None)), CPU, dtype, MXFP4, shape, 37, "ok"
    )
    checks.check_fused_moe_quant(
        table_with(fused_moe_quant_with(None)), CPU, dtype, MXFP4, shape, 13, True, "ok"
    )
    checks.check_quant_fp8_group(table_with(quant_fp8_group_with(None)), CPU, dtype, 13, K, 128, "ok")


@DTYPES
@FP8_FORMATS
@pytest.mark.parametrize("bug", LINEAR_BUGS)
def test_fp8_linear_bugs_fail(bug: str, fmt: WeightFormat, dtype: torch.dtype) -> None:
    with pytest.raises(AssertionError, match=r"fp8_linear\[.*relative error"):
        checks.check_fp8_linear(
            table_with(fp8_linear_with(bug)), CPU, dtype, fmt, K, N, checks.QUANT_ROWS, bug
        )


@DTYPES
@FP8_FORMATS
@pytest.mark.parametrize("bug", ["scale_after_k_loop", "next_k_block", "transposed"])
def test_fp8_linear_w8a8_bugs_fail(bug: str, fmt: WeightFormat, dtype: torch.dtype) -> None:
    table = table_with(fp8_linear_w8a8_with(bug))
    with pytest.raises(AssertionError, match=r"fp8_linear_w8a8\[.*relative error"):
        checks.check_fp8_linear_w8a8(table, CPU, dtype, fmt, K, N, checks.QUANT_ROWS, bug)


EXPERT_BUGS = [
    *((f, bug) for f in FP8 for bug in ("scale_after_k_loop", "next_k_block", "transposed")),
    *(("mxfp4", bug) for bug in ("nibble_swap", "scale_after_k_loop", "next_k_block")),
]


@DTYPES
@pytest.mark.parametrize(("fmt_id", "bug"), EXPERT_BUGS)
def test_grouped_gemm_quant_bugs_fail(fmt_id: str, bug: str, dtype: torch.dtype) -> None:
    fmt = FP8.get(fmt_id, MXFP4)
    table = table_with(grouped_gemm_quant_with(bug))
    with pytest.raises(AssertionError, match=r"grouped_gemm_quant\[.*relative error"):
        checks.check_grouped_gemm_quant(table, CPU, dtype, fmt, quant_moe("odd", fmt), 37, bug)


@DTYPES
@pytest.mark.parametrize(("fmt_id", "bug"), [("mxfp4", "nibble_swap"), ("fp8-128x128-f32", "transposed"),
                                             ("fp8-32x32-ue8m0", "scale_after_k_loop")])  # fmt: skip
def test_fused_moe_quant_bugs_fail(fmt_id: str, bug: str, dtype: torch.dtype) -> None:
    fmt = FP8.get(fmt_id, MXFP4)
    table = table_with(fused_moe_quant_with(bug))
    with pytest.raises(AssertionError, match=r"fused_moe_quant\[.*relative error"):
        checks.check_fused_moe_quant(table, CPU, dtype, fmt, quant_moe("odd", fmt), 13, True, bug)


@DTYPES
@pytest.mark.parametrize("group", [128, 32])
def test_ue8m0_scales_rounded_down_fail(group: int, dtype: torch.dtype) -> None:
    with pytest.raises(AssertionError, match=r"quant_fp8_group\[.*ue8m0=True\].*ue8m0 scales must be"):
        checks.check_quant_fp8_group(
            table_with(quant_fp8_group_with("ue8m0_down")), CPU, dtype, 13, K, group, "down"
        )


def _claims_invariance(names: list[str]) -> OpTable:
    """The reference's default (fast) quantised kernels, wrongly declared batch-invariant."""
    from deepinfer.backends.reference import quant as reference_quant

    table = OpTable("claims-too-much-quant")
    for name in names:
        table.implement(getattr(reference_quant, name))
    table.declare_invariant(names, "claimed without reason")
    table.use_reference_for(sorted(set(interface_ops()) - set(names)), "test")
    return table.finalize()


@pytest.mark.parametrize(
    ("op", "fmt"),
    [("fp8_linear", FP8["fp8-128x128-f32"]), ("fp8_linear_w8a8", FP8["fp8-32x32-ue8m0"]),
     ("fused_moe_quant", MXFP4), ("grouped_gemm_quant", MXFP4)],
)  # fmt: skip
def test_the_invariance_check_catches_batch_variant_quantised_kernels(op: str, fmt: WeightFormat) -> None:
    with pytest.raises(AssertionError, match=rf"{op}(\.out0)?: not batch-invariant"):
        invariance.check_quant(_claims_invariance([op]), CPU, torch.float32, fmt, f"variant-{op}")


@FP8_FORMATS
def test_an_unwritten_partial_last_block_fails(fmt: WeightFormat) -> None:
    """A kernel that writes whole N blocks only leaves the partial last one as allocated: NaN under
    the checks' NaN-filled memory, on the CPU too."""

    def fp8_linear(x, weight, weight_scale, block, bias):
        full = weight.shape[0] // block[0] * block[0]
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        out[:, :full] = fp8_linear_with(None)(x, weight[:full], weight_scale[: full // block[0]], block, None)
        return out if bias is None else out + bias

    with pytest.raises(AssertionError, match=r"fp8_linear\[.*non-finite"):
        checks.check_fp8_linear(
            table_with(fp8_linear), CPU, torch.float32, fmt, K, N, checks.QUANT_ROWS, "tail"
        )


def test_an_unwritten_last_group_scale_fails() -> None:
    def quant_fp8_group(x, group, ue8m0):
        values, scale = quant_fp8_group_with(None)(x, group, ue8m0)
        unwritten = torch.empty_like(scale)
        unwritten[:, :-1] = scale[:, :-1]
        return values, unwritten

    with pytest.raises(AssertionError, match=r"quant_fp8_group\[.*non-finite"):
        checks.check_quant_fp8_group(table_with(quant_fp8_group), CPU, torch.float32, 13, K, 128, "unwritten")
