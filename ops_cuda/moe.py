"""The routed-expert MLP: sort (token, expert) pairs by expert, grouped GEMM with SwiGLU, grouped GEMM,
weighted combine.

The pairs are sorted on the device (remote experts, id < 0, sort last and get no tile); the first GEMM
reads token rows straight from ``hidden`` through the sort order and applies SwiGLU in its epilogue,
so the gate/up activations are never written. The combine sums each token's k expert outputs in a
fixed order (no atomics: deterministic), and serves ``ep_combine`` as well. No step synchronises with
the host, so a decode step holding fused_moe can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.grouped_gemm import (
    INVARIANT_BLOCK_M,
    launch_grouped_gemm,
    tile_block_m,
    tile_schedule,
)
from deepinfer.ops_cuda.runtime import check_device, pow2


@triton.jit
def _combine_kernel(
    y_ptr, row_ptr, weight_ptr, out_ptr, D, stride_y, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_ptr + t * TOP_K + j).to(tl.int64)
        if row >= 0:
            y = tl.load(y_ptr + row * stride_y + cols, mask=col_ok, other=0.0)
            acc += tl.load(weight_ptr + t * TOP_K + j) * y.to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def combine_pairs(y: Tensor, row_of_pair: Tensor, weights: Tensor) -> Tensor:
    """out[t] = sum_j weights[t, j] * y[row_of_pair[t, j]] accumulated in float32, skipping pairs whose
    row is negative. y: [P, D]; row_of_pair: [T, k] int64; weights: [T, k]. Returns [T, D] in y's dtype."""
    tokens, top_k = row_of_pair.shape
    width = y.shape[1]
    out = torch.empty((tokens, width), dtype=y.dtype, device=y.device)
    block_d = min(1024, pow2(width))
    if tokens:
        _combine_kernel[(tokens, triton.cdiv(width, block_d))](
            y,
            row_of_pair.contiguous(),
            weights.to(torch.float32).contiguous(),
            out,
            width,
            y.stride(0),
            TOP_K=top_k,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def inverse_order(order: Tensor) -> Tensor:
    """The position of each element in ``order`` (a permutation [P] int64): inv[order[p]] = p."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


@OPS.implement
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """hidden: [T, D]; w13: [E, 2I, D] (gate rows, then up rows); w2: [E, D, I]; topk_weights: [T, k]
    float32; topk_ids: [T, k] int32/int64 (negative: another rank's expert). Returns a new [T, D]."""
    pairs = topk_ids.numel()
    return _fused_moe(hidden, w13, w2, topk_weights, topk_ids, tile_block_m(pairs, w13.shape[0]))


@OPS.implement_invariant(
    f"both expert GEMMs with one tile height ({INVARIANT_BLOCK_M} rows) whatever the batch, no split-K; "
    "each token's k outputs summed in its top-k slot order by one program"
)
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:  # noqa: F811
    return _fused_moe(hidden, w13, w2, topk_weights, topk_ids, INVARIANT_BLOCK_M)


def _fused_moe(
    hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, block_m: int
) -> Tensor:
    check_device(hidden, w13, w2, topk_weights, topk_ids)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    pairs = tokens * top_k
    expert = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where(expert < 0, num_experts, expert)
    order = torch.argsort(key, stable=True)
    sizes = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    sizes.scatter_add_(0, key, torch.ones_like(key))
    schedule = tile_schedule(sizes[:num_experts], pairs, block_m)
    token_of_row = (order // top_k).to(torch.int32)
    act = launch_grouped_gemm(hidden, token_of_row, w13, schedule, pairs, swiglu=True)
    y = launch_grouped_gemm(act, None, w2, schedule, pairs, swiglu=False)
    row_of_pair = torch.where(expert < 0, -1, inverse_order(order)).view(tokens, top_k)
    return combine_pairs(y, row_of_pair, topk_weights)
