"""Rotary embedding of the MLA rope query heads and the shared rope key, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2


@triton.jit
def _rotate_pairs(src_ptr, dst_ptr, first, second, mask, cos, sin):
    """Rotate the dim pairs (first, second) of one tile by (cos, sin), computing in float32."""
    x1 = tl.load(src_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + second, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst_ptr + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_out_ptr,
    H,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_cs,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    pair_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=pair_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=pair_ok, other=0.0)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    _rotate_pairs(k_ptr + t * stride_kt, k_out_ptr + t * 2 * HALF, first, second, pair_ok, cos, sin)
    h = tl.arange(0, BLOCK_H)
    mask = (h < H)[:, None] & pair_ok[None, :]
    _rotate_pairs(
        q_ptr + t * stride_qt + h[:, None] * stride_qh,
        q_out_ptr + t * H * 2 * HALF + h[:, None] * 2 * HALF,
        first[None, :],
        second[None, :],
        mask,
        cos[None, :],
        sin[None, :],
    )


@OPS.implement
def rope(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    """q: [T, H, R] (any strides but unit along R); k: [T, R]; positions: [T] int64; cos_sin_cache:
    [P, R] float32. Returns new contiguous ``(q_rot, k_rot)`` in the input dtypes."""
    check_device(q, k, positions, cos_sin_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    tokens, heads, rope_dim = q.shape
    q_out = torch.empty((tokens, heads, rope_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, rope_dim), dtype=k.dtype, device=k.device)
    if tokens:
        _rope_kernel[(tokens,)](
            q,
            k,
            positions,
            cos_sin_cache,
            q_out,
            k_out,
            heads,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            cos_sin_cache.stride(0),
            HALF=rope_dim // 2,
            INTERLEAVED=interleaved,
            BLOCK_H=pow2(heads),
            BLOCK_HALF=pow2(rope_dim // 2),
            num_warps=4,
        )
    return q_out, k_out
