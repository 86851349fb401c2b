"""Routed experts with quantised weights: the grouped GEMM over expert-sorted rows and the fused MoE,
for FP8 block-scaled experts (V3 to V4.1) and MXFP4 experts (V4).

The rows are sorted by expert and cut into BLOCK_M tiles that each belong to one expert (the tile
schedule of ``grouped_gemm``, built on the device: no host synchronisation, CUDA-graph safe; tiles past
the used ones carry expert -1 and exit). Activations stay in their dtype (W8A16 / W4A16, the ops'
definition); each weight tile is converted in registers:

- FP8: e4m3 codes (loaded as ``float8_e4m3fn`` on SM89+, as uint8 decoded by bit operations on
  SM80/SM86), one ``tl.dot`` per K block of the scale grid from a zero accumulator, multiplied by the
  block's scale (one per column of the tile, or one for the tile when it lies in one scale block), then
  added to the float32 accumulator.
- MXFP4: two e2m1 codes per byte (low nibble = even column) unpacked and decoded by bit operations,
  multiplied by their e8m0 power of two (one per 32 columns of a row) in float32 and cast to the
  activation dtype, which holds the product exactly (bfloat16 and float32 always; float16 while
  ``2 ** (e - 127) >= 2 ** -23``, i.e. for every scale a real checkpoint uses), then one dot per tile.

The first GEMM of ``fused_moe_quant`` gathers its rows from ``hidden`` through the sort order and
applies SwiGLU in its epilogue; the second multiplies each row by its router weight in its epilogue,
so the combine is a plain ordered sum of each token's k rows (no atomics: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.backends.quant import MX_BLOCK, WeightFormat, check_pair, logical_k
from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.activation import silu_mul
from deepinfer.ops_cuda.grouped_gemm import INVARIANT_BLOCK_M, TileSchedule, tile_block_m, tile_schedule
from deepinfer.ops_cuda.moe import combine_pairs, inverse_order
from deepinfer.ops_cuda.quant_codec import e2m1_decode, e4m3_decode, e8m0_to_float
from deepinfer.ops_cuda.quant_linear import fp8_dot_supported
from deepinfer.ops_cuda.runtime import check_device, device_limits, pipeline_stages, pow2

# Outputs are allocated through this name (tests replace it with a NaN-filling allocator).
empty = torch.empty

_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _fp8_tile(w_rows, kk, mask, NATIVE_FP8: tl.constexpr, DTYPE: tl.constexpr):
    if NATIVE_FP8:
        values = tl.load(w_rows + kk[None, :], mask=mask, other=0.0).to(DTYPE)
    else:
        values = e4m3_decode(tl.load(w_rows + kk[None, :], mask=mask, other=0)).to(DTYPE)
    return values


@triton.jit
def _mxfp4_tile(
    w_rows, s_rows, k0, K, col_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr
):
    """[BLOCK_N, BLOCK_K] weights of columns k0 .. k0 + BLOCK_K: packed bytes at k / 2, e8m0 at k / 32."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_rows + byte[None, :], mask=col_ok[:, None] & (byte < K // 2)[None, :], other=0).to(
        tl.int32
    )
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))  # low nibble = even column
    group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    exps = tl.load(s_rows + group[None, :], mask=col_ok[:, None] & (group < K // 32)[None, :], other=127)
    scale = e8m0_to_float(exps.to(tl.int32))
    w = tl.reshape(e2m1_decode(codes), (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DTYPE)


@triton.jit
def _grouped_gemm_quant_kernel(
    a_ptr,
    a_rows_ptr,
    w_ptr,
    ws_ptr,
    row_weight_ptr,
    c_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    num_tiles,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_c,
    MXFP4: tl.constexpr,
    BN_SCALE: tl.constexpr,
    BK_SCALE: tl.constexpr,
    SCALAR_W_SCALE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROW_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[r, n] = dequant(w[e]) [n] . a[src(r)] for the rows r of each tile (src = a_rows[r] with GATHER);
    with SWIGLU w[e] holds 2N rows (gate, then up) and c = silu(gate) * up; with ROW_WEIGHT c[r] is
    multiplied by row_weight[r]. K is the logical (unpacked) column count."""
    pid = tl.program_id(0)
    tile = pid % num_tiles  # the tiles of one weight block run side by side and share it through L2
    n_block = pid // num_tiles
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(tile_end_ptr + tile)
        src = rows
        if GATHER:
            src = tl.load(a_rows_ptr + rows, mask=row_ok, other=0)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        a_rows = a_ptr + src.to(tl.int64)[:, None] * stride_a
        w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        w_up = w_gate + N * stride_wn
        s_base = ws_ptr + expert.to(tl.int64) * stride_wse
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if MXFP4:
            s_gate = s_base + cols.to(tl.int64)[:, None] * stride_wsn
            s_up = s_gate + N * stride_wsn
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
                w = _mxfp4_tile(w_gate, s_gate, k0, K, col_ok, BLOCK_N, BLOCK_K, DOT_DTYPE)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
                if SWIGLU:
                    w = _mxfp4_tile(w_up, s_up, k0, K, col_ok, BLOCK_N, BLOCK_K, DOT_DTYPE)
                    up = tl.dot(a, tl.trans(w), up, input_precision=PRECISION)
        else:
            if SCALAR_W_SCALE:
                s_gate = s_base + (n_block * BLOCK_N // BN_SCALE) * stride_wsn
                s_up = s_base + ((N + n_block * BLOCK_N) // BN_SCALE) * stride_wsn
            else:
                s_gate = s_base + (cols // BN_SCALE) * stride_wsn
                s_up = s_base + ((cols + N) // BN_SCALE) * stride_wsn
            for kb in range(0, tl.cdiv(K, BK_SCALE)):
                part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                part_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sub in tl.static_range(0, BK_SCALE, BLOCK_K):
                    within = sub + tl.arange(0, BLOCK_K)
                    kk = kb * BK_SCALE + within
                    k_ok = (kk < K) & (within < BK_SCALE)
                    a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    w_mask = col_ok[:, None] & k_ok[None, :]
                    w = _fp8_tile(w_gate, kk, w_mask, NATIVE_FP8, DOT_DTYPE)
                    part = tl.dot(a, tl.trans(w), part, input_precision=PRECISION)
                    if SWIGLU:
                        w = _fp8_tile(w_up, kk, w_mask, NATIVE_FP8, DOT_DTYPE)
                        part_up = tl.dot(a, tl.trans(w), part_up, input_precision=PRECISION)
                if SCALAR_W_SCALE:
                    acc += part * tl.load(s_gate + kb)
                    if SWIGLU:
                        up += part_up * tl.load(s_up + kb)
                else:
                    acc += part * tl.load(s_gate + kb, mask=col_ok, other=0.0)[None, :]
                    if SWIGLU:
                        up += part_up * tl.load(s_up + kb, mask=col_ok, other=0.0)[None, :]
        if SWIGLU:
            acc = silu_mul(acc, up)
        if ROW_WEIGHT:
            acc = acc * tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0)[:, None]
        dst = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_k(fmt: WeightFormat, k: int, small: bool) -> int:
    """K tile: a multiple of the 32-column scale group for MXFP4, a divisor of the scale block for FP8;
    at most 64 when ``small`` (FP8 decoded by bit operations, or float32 operands: their register tiles
    spill at 128 on SM80), else 128."""
    most = 64 if small else 128
    if fmt.kind == "mxfp4":
        return min(most, max(MX_BLOCK, pow2(k)))
    bk = fmt.block[1]
    block_k = 16
    while block_k * 2 <= min(most, bk) and bk % (block_k * 2) == 0:
        block_k *= 2
    return block_k


def launch_grouped_gemm_quant(
    a: Tensor,
    a_rows: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    fmt: WeightFormat,
    schedule: TileSchedule,
    num_rows: int,
    swiglu: bool,
    row_weight: Tensor | None,
    native_fp8: bool,
) -> Tensor:
    """c [num_rows, Nout] in a's dtype (Nout = weight rows, halved with ``swiglu``).

    a: [*, K] (rows gathered through a_rows [num_rows] int32 when given); weight: [E, Nout or 2 Nout,
    K or K / 2] in ``fmt`` with weight_scale; row_weight: [num_rows] float32 multiplied into each row
    (or None). Rows no tile covers are left unwritten."""
    n_rows_w = weight.shape[1]
    n_out = n_rows_w // 2 if swiglu else n_rows_w
    k = logical_k(weight, fmt)
    c = empty((num_rows, n_out), dtype=a.dtype, device=a.device)
    block_n = 64 if swiglu else 128
    block_k = _block_k(fmt, k, small=not native_fp8 or a.dtype == torch.float32)
    bn = fmt.block[0]
    # shared memory per stage: the activation tile and each weight tile's bytes as loaded, plus (as
    # compiled for SM80/SM86, measured with tests/nvidia/compile_check.py) its copy converted to the
    # activation dtype; SM89+ keep the converted tile in registers
    raw = 0.5 if fmt.kind == "mxfp4" else 1.0
    converted = 0 if native_fp8 else a.element_size()
    w_bytes = int(block_n * block_k * (raw + converted)) * (2 if swiglu else 1)
    stage_bytes = schedule.block_m * block_k * a.element_size() + w_bytes
    stages = pipeline_stages(device_limits(a.device), stage_bytes)
    num_tiles = schedule.expert.numel()
    w_arg = weight if (native_fp8 or fmt.kind == "mxfp4") else weight.view(torch.uint8)
    if num_rows and n_out:
        _grouped_gemm_quant_kernel[(num_tiles * triton.cdiv(n_out, block_n),)](
            a,
            a if a_rows is None else a_rows,
            w_arg,
            weight_scale,
            weight_scale if row_weight is None else row_weight,
            c,
            schedule.expert,
            schedule.start,
            schedule.end,
            num_tiles,
            n_out,
            k,
            a.stride(0),
            weight.stride(0),
            weight.stride(1),
            weight_scale.stride(0),
            weight_scale.stride(1),
            c.stride(0),
            MXFP4=fmt.kind == "mxfp4",
            BN_SCALE=bn,
            BK_SCALE=fmt.block[1],
            SCALAR_W_SCALE=bn % block_n == 0 and (not swiglu or n_out % block_n == 0),
            NATIVE_FP8=native_fp8,
            DOT_DTYPE=_DOT_DTYPES[a.dtype],
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32 is the default; fp32 exact
            GATHER=a_rows is not None,
            SWIGLU=swiglu,
            ROW_WEIGHT=row_weight is not None,
            BLOCK_M=schedule.block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=8 if schedule.block_m >= 128 else 4,
            num_stages=stages,
        )
    return c


def _check_experts(
    what: str, dtype: torch.dtype, weight: Tensor, scale: Tensor, fmt: WeightFormat, k: int
) -> None:
    """Raise ValueError naming ``what`` unless activations of ``dtype`` with ``k`` columns can be
    multiplied by the expert weights (weight, scale) in ``fmt``."""
    if not isinstance(fmt, WeightFormat):
        raise ValueError(
            f"{what}: fmt must be a deepinfer.backends.quant.WeightFormat, got {type(fmt).__name__}"
        )
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"{what}: activations must be float32, float16 or bfloat16, got {dtype}")
    if weight.dim() != 3:
        raise ValueError(f"{what}: expert weights must be [E, N, K], got shape {tuple(weight.shape)}")
    check_pair(weight, scale, fmt, f"{what} weight")
    if logical_k(weight, fmt) != k:
        raise ValueError(
            f"{what}: activations have {k} columns, the weights {logical_k(weight, fmt)} ({fmt.name})"
        )


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor, block_m: int
) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"grouped_gemm_quant: x must be [N, K], got shape {tuple(x.shape)}")
    _check_experts("grouped_gemm_quant", x.dtype, weight, weight_scale, fmt, x.shape[1])
    if tuple(group_sizes.shape) != (weight.shape[0],):
        raise ValueError(
            f"grouped_gemm_quant: group_sizes must be [{weight.shape[0]}], got {tuple(group_sizes.shape)}"
        )
    check_device(x, weight, weight_scale, group_sizes)
    x, weight = _rows(x), _rows(weight)
    schedule = tile_schedule(group_sizes, x.shape[0], block_m)
    native = fp8_dot_supported(x.device)
    return launch_grouped_gemm_quant(
        x, None, weight, weight_scale.contiguous(), fmt, schedule, x.shape[0], False, None, native
    )


@OPS.implement
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    return _grouped_gemm_quant(
        x, weight, weight_scale, fmt, group_sizes, tile_block_m(x.shape[0], weight.shape[0])
    )


@OPS.implement_invariant(
    f"one tile height ({INVARIANT_BLOCK_M} rows) whatever the row count, BLOCK_N/BLOCK_K fixed by the "
    "format, no split-K"
)
def grouped_gemm_quant(  # noqa: F811 (the mode's variant)
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    return _grouped_gemm_quant(x, weight, weight_scale, fmt, group_sizes, INVARIANT_BLOCK_M)


def _fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
    block_m: int | None,
) -> Tensor:
    if hidden.dim() != 2:
        raise ValueError(f"fused_moe_quant: hidden must be [T, D], got shape {tuple(hidden.shape)}")
    _check_experts("fused_moe_quant w13", hidden.dtype, w13, w13_scale, fmt, hidden.shape[1])
    inter = w13.shape[1] // 2
    if w13.shape[1] % 2:
        raise ValueError(f"fused_moe_quant: w13 must hold 2I rows (gate, then up), got {w13.shape[1]}")
    _check_experts("fused_moe_quant w2", hidden.dtype, w2, w2_scale, fmt, inter)
    if w2.shape[0] != w13.shape[0] or w2.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"fused_moe_quant: w2 must be [E, D, I] = [{w13.shape[0]}, {hidden.shape[1]}, {inter}] "
            f"(stored), got {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"fused_moe_quant: topk_ids and topk_weights must both be [T, k] with T = {hidden.shape[0]}, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    check_device(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    hidden, w13, w2 = _rows(hidden), _rows(w13), _rows(w2)
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    pairs = tokens * top_k
    if block_m is None:
        block_m = tile_block_m(pairs, num_experts)
    expert = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where(expert < 0, num_experts, expert)  # another rank's experts sort last, get no tile
    order = torch.argsort(key, stable=True)
    sizes = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    sizes.scatter_add_(0, key, torch.ones_like(key))
    schedule = tile_schedule(sizes[:num_experts], pairs, block_m)
    native = fp8_dot_supported(hidden.device)
    token_of_row = (order // top_k).to(torch.int32)
    act = launch_grouped_gemm_quant(
        hidden, token_of_row, w13, w13_scale, fmt, schedule, pairs, True, None, native
    )
    row_weight = topk_weights.reshape(-1).to(torch.float32)[order].contiguous()
    y = launch_grouped_gemm_quant(act, None, w2, w2_scale, fmt, schedule, pairs, False, row_weight, native)
    row_of_pair = torch.where(expert < 0, -1, inverse_order(order)).view(tokens, top_k)
    # the router weights are already in y: the combine sums each token's rows in top-k slot order
    return combine_pairs(
        y, row_of_pair, torch.ones((tokens, top_k), dtype=torch.float32, device=hidden.device)
    )


@OPS.implement
def fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    return _fused_moe_quant(hidden, w13, w13_scale, w2, w2_scale, fmt, topk_weights, topk_ids, None)


@OPS.implement_invariant(
    f"both expert GEMMs with one tile height ({INVARIANT_BLOCK_M} rows) whatever the batch, no split-K; the "
    "router weight applied per row in the second GEMM's epilogue; each token's k rows summed in top-k slot "
    "order by one program"
)
def fused_moe_quant(  # noqa: F811 (the mode's variant)
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    return _fused_moe_quant(
        hidden, w13, w13_scale, w2, w2_scale, fmt, topk_weights, topk_ids, INVARIANT_BLOCK_M
    )
