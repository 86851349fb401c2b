"""Grouped GEMM over rows sorted by expert: each BLOCK_M-row tile belongs to one expert.

The tile schedule is built on the device from the group sizes (no host synchronisation, so it can be
captured in a CUDA graph): a fixed number of tile slots, ``cdiv(rows, BLOCK_M) + E``, bounds the tiles
any split of the rows can need, and unused slots carry expert -1 and exit at once. The kernel can gather
its input rows through an index (the routed tokens of fused_moe, never copied) and can apply SwiGLU to
the gate and up halves of the weight in its epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.activation import silu_mul
from deepinfer.ops_cuda.runtime import block_pow2, check_device, device_limits, pipeline_stages


@dataclass(frozen=True, slots=True)
class TileSchedule:
    """Tile slot i covers rows [start[i], end[i]) of expert[i] (-1: unused slot); int32 tensors."""

    expert: Tensor
    start: Tensor
    end: Tensor
    block_m: int


INVARIANT_BLOCK_M = 32  # deterministic mode: one tile height whatever the row count


def tile_block_m(num_rows: int, num_experts: int) -> int:
    """Tile height from the mean rows per expert: 16 at decode, up to 128 for prefill batches."""
    return min(128, block_pow2(num_rows // max(1, num_experts)))


def tile_schedule(group_sizes: Tensor, num_rows: int, block_m: int) -> TileSchedule:
    """Tiles for rows grouped by expert: group_sizes [E] counts rows per expert, summing to at most
    num_rows (rows past the sum get no tile)."""
    sizes = group_sizes.to(torch.int64)
    num_experts = sizes.numel()
    ends = sizes.cumsum(0)
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    slot = torch.arange(triton.cdiv(num_rows, block_m) + num_experts, device=sizes.device)
    expert = torch.searchsorted(tile_ends, slot, right=True)
    used = expert < num_experts
    expert = expert.clamp_(max=num_experts - 1)
    start = ends[expert] - sizes[expert] + (slot - tile_ends[expert] + tiles[expert]) * block_m
    end = torch.minimum(start + block_m, ends[expert])
    return TileSchedule(
        torch.where(used, expert, -1).to(torch.int32), start.to(torch.int32), end.to(torch.int32), block_m
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_rows_ptr,
    w_ptr,
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
    stride_c,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[r, n] = w[e] [n] . a[src(r)] for the rows r of each tile (src = a_rows[r] with GATHER).

    With SWIGLU, w[e] holds 2N rows (gate then up) and c[r, n] = silu(gate . a) * (up . a)."""
    pid = tl.program_id(0)
    tile = pid % num_tiles  # tiles of one weight block run side by side and share it through L2
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
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            if SWIGLU:
                w_up = tl.load(
                    w_rows + N * stride_wn + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
                )
                up = tl.dot(a, tl.trans(w_up), up, input_precision="ieee")
        if SWIGLU:
            acc = silu_mul(acc, up)
        dst = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
        tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch_grouped_gemm(
    a: Tensor, a_rows: Tensor | None, weight: Tensor, schedule: TileSchedule, num_rows: int, swiglu: bool
) -> Tensor:
    """Returns c [num_rows, Nout] in a's dtype (Nout = weight rows, halved with ``swiglu``).

    a: [*, K] (rows gathered through a_rows [num_rows] int32 when given, else a has num_rows rows);
    weight: [E, Nout or 2 * Nout, K]. Rows no tile covers are left unwritten."""
    n_out = weight.shape[1] // 2 if swiglu else weight.shape[1]
    k = weight.shape[2]
    c = torch.empty((num_rows, n_out), dtype=a.dtype, device=a.device)
    block_n = 64 if swiglu else 128
    block_k = 64 if k >= 64 else block_pow2(k)
    stage_bytes = (schedule.block_m + block_n * (2 if swiglu else 1)) * block_k * a.element_size()
    stages = pipeline_stages(device_limits(a.device), stage_bytes)
    num_tiles = schedule.expert.numel()
    if num_rows:
        _grouped_gemm_kernel[(num_tiles * triton.cdiv(n_out, block_n),)](
            a,
            a if a_rows is None else a_rows,
            weight,
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
            c.stride(0),
            GATHER=a_rows is not None,
            SWIGLU=swiglu,
            BLOCK_M=schedule.block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=8 if schedule.block_m >= 128 else 4,
            num_stages=stages,
        )
    return c


@OPS.implement
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """x: [N, K] rows sorted by expert; weight: [E, Nout, K]; group_sizes: [E] int64 summing to N (not
    checked: that would synchronise with the device). Returns a new [N, Nout] in x's dtype."""
    return _grouped_gemm(x, weight, group_sizes, tile_block_m(x.shape[0], weight.shape[0]))


def _grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor, block_m: int) -> Tensor:
    check_device(x, weight, group_sizes)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    schedule = tile_schedule(group_sizes, x.shape[0], block_m)
    return launch_grouped_gemm(x, None, weight, schedule, x.shape[0], swiglu=False)


@OPS.implement_invariant(
    f"one tile height ({INVARIANT_BLOCK_M} rows) whatever the row count, fixed BLOCK_N/BLOCK_K, no split-K"
)
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:  # noqa: F811
    return _grouped_gemm(x, weight, group_sizes, INVARIANT_BLOCK_M)
