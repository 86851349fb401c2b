"""Absorbed MLA decode over the paged latent cache: split-KV flash decoding plus a reduction pass.

Multi-query attention with one shared KV "head": the key of cached token j is its whole cache row
(latent then rope, L + R wide) and the value is the latent part. A program handles one request, one
split of its visible keys and BLOCK_M query rows, a row being a (query token, head) pair of that
request, so the heads and the draft tokens of a speculative step share every key tile they load. Key
tiles are read through the block table one token at a time (a 64-token page holds two 32-token
tiles). Each split writes its normalised partial output and log-sum-exp; a second kernel merges the
splits. The grid depends only on tensor shapes, never on their values, so the op is CUDA-graph safe.

Deterministic mode (``invariant_config``): the split count normally follows the batch (about two waves
of programs), so a request's reduction order depends on its batch mates. The batch-invariant variant
cuts keys at fixed positions (every ``INVARIANT_SPLIT`` keys from position 0), uses one BLOCK_M whatever
the query count, always goes through the partials, and merges the splits one after another in position
order, so a query token's bits depend only on its own keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.cache import cache_rows
from deepinfer.ops_cuda.online_softmax import online_softmax_step
from deepinfer.ops_cuda.runtime import (
    LOG2E,
    DeviceLimits,
    block_pow2,
    check_device,
    device_limits,
    pipeline_stages,
    pow2,
)


@triton.jit
def _decode_partials_kernel(
    q_nope_ptr,
    q_pe_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    H,
    L,
    R,
    window,
    split_size,
    scale_log2,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_bt,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    FIXED_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Attention of BLOCK_M (query, head) rows of request b over split ``split`` of its keys.

    DIRECT (one split): the normalised output goes straight to out [T, H, L]. Otherwise to
    part_out [T, H, NUM_SPLITS, L] (float32) with part_lse [T, H, NUM_SPLITS] (log2 units)."""
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    n_q = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // H
    head = rows % H
    row_ok = q_idx < n_q
    token = (q_start + q_idx).to(tl.int64)
    q_pos = seq_len - n_q + q_idx

    if FIXED_SPLITS:
        # Fixed positions: split s holds keys [s * split_size, (s + 1) * split_size), whatever the batch.
        start = split * split_size
        end = tl.minimum(start + split_size, seq_len)
    else:
        # Keys visible to any query of the request, shared out among the splits in whole tiles.
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(seq_len - n_q - window + 1, 0)
        per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = kv_lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)

    cl = tl.arange(0, BLOCK_L)
    cr = tl.arange(0, BLOCK_R)
    q_nope = tl.load(
        q_nope_ptr + token[:, None] * stride_qn_t + head[:, None] * stride_qn_h + cl[None, :],
        mask=row_ok[:, None] & (cl < L)[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + token[:, None] * stride_qp_t + head[:, None] * stride_qp_h + cr[None, :],
        mask=row_ok[:, None] & (cr < R)[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        page = tl.load(block_table_ptr + b * stride_bt + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        key_row = cache_ptr + (page * PAGE + pos % PAGE) * (L + R)
        k_lat = tl.load(key_row[:, None] + cl[None, :], mask=key_ok[:, None] & (cl < L)[None, :], other=0.0)
        k_pe = tl.load(
            key_row[:, None] + L + cr[None, :], mask=key_ok[:, None] & (cr < R)[None, :], other=0.0
        )
        s = tl.dot(q_nope, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee") * scale_log2
        visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= pos[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = online_softmax_step(s, visible, m_i, l_i, acc, k_lat)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_mask = row_ok[:, None] & (cl < L)[None, :]
    if DIRECT:
        dst = out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + cl[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (token * H + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * L + cl[None, :], o, mask=o_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    H,
    L,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """out[t, h] = the partial outputs of every split, weighted by their share of the softmax mass."""
    row = tl.program_id(0).to(tl.int64)  # t * H + h
    s = tl.arange(0, BLOCK_S)
    cl = tl.arange(0, BLOCK_L)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s)[:, None] * L + cl[None, :],
        mask=(s < NUM_SPLITS)[:, None] & (cl < L)[None, :],
        other=0.0,
    )
    o = tl.sum(parts * weight[:, None], axis=0)
    dst = out_ptr + (row // H) * stride_o_t + (row % H) * stride_o_h + cl
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=cl < L)


@triton.jit
def _combine_splits_in_order_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    H,
    L,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Deterministic merge: the splits' partial outputs added one after another in position order
    (splits a row saw nothing of have lse = -inf and add exact zeros)."""
    row = tl.program_id(0).to(tl.int64)  # t * H + h
    cl = tl.arange(0, BLOCK_L)
    top = float("-inf")
    for s in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(part_lse_ptr + row * NUM_SPLITS + s))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_L], tl.float32)
    total = 0.0
    for s in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_lse_ptr + row * NUM_SPLITS + s) - top)
        part = tl.load(part_out_ptr + (row * NUM_SPLITS + s) * L + cl, mask=cl < L, other=0.0)
        acc += weight * part
        total += weight
    dst = out_ptr + (row // H) * stride_o_t + (row % H) * stride_o_h + cl
    tl.store(dst, (acc / total).to(out_ptr.dtype.element_ty), mask=cl < L)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    split_size: int = 0  # > 0: fixed-position splits of this many keys, merged in order (deterministic)


INVARIANT_SPLIT = 256  # deterministic mode: keys per split (a multiple of block_n)


MIN_TILES_PER_SPLIT = 4  # below this a split's reduction traffic outweighs the parallelism it adds


def decode_config(
    limits: DeviceLimits,
    element_size: int,
    num_reqs: int,
    rows_per_req: int,
    max_keys: int,
    width: int,
) -> DecodeConfig:
    """Tiles, split count and pipeline depth for one launch (shape-only: graph-safe).

    rows_per_req = max_query_len * H; max_keys = block-table width * 64; width = L + R."""
    block_m = min(64 if element_size <= 2 else 16, block_pow2(rows_per_req))
    block_n = 32
    row_blocks = triton.cdiv(rows_per_req, block_m)
    most_splits = max(1, triton.cdiv(max_keys, MIN_TILES_PER_SPLIT * block_n))
    wanted = triton.cdiv(2 * limits.sm_count, max(1, num_reqs * row_blocks))  # about two waves
    stages = pipeline_stages(limits, block_n * width * element_size, reserved=block_m * width * element_size)
    return DecodeConfig(block_m, block_n, min(wanted, most_splits), num_warps=8, num_stages=min(stages, 2))


def invariant_config(limits: DeviceLimits, element_size: int, max_keys: int, width: int) -> DecodeConfig:
    """Deterministic mode: tiles fixed by the dtype, splits every INVARIANT_SPLIT key positions."""
    block_m, block_n = (64 if element_size <= 2 else 16), 32
    stages = pipeline_stages(limits, block_n * width * element_size, reserved=block_m * width * element_size)
    return DecodeConfig(
        block_m,
        block_n,
        max(1, triton.cdiv(max_keys, INVARIANT_SPLIT)),
        num_warps=8,
        num_stages=min(stages, 2),
        split_size=INVARIANT_SPLIT,
    )


def launch_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    config: DecodeConfig,
) -> Tensor:
    """Run the decode kernels with an explicit configuration (the op picks one with decode_config)."""
    tokens, heads, latent = q_nope.shape
    rope_dim = q_pe.shape[-1]
    num_reqs = seq_lens.shape[0]
    out = torch.empty((tokens, heads, latent), dtype=q_nope.dtype, device=q_nope.device)
    splits = config.num_splits
    fixed = config.split_size > 0
    direct = splits == 1 and not fixed
    if direct:
        part_out = part_lse = out
    else:
        part_out = torch.empty((tokens, heads, splits, latent), dtype=torch.float32, device=out.device)
        part_lse = torch.empty((tokens, heads, splits), dtype=torch.float32, device=out.device)
    rows = max_query_len * heads
    grid = (triton.cdiv(rows, config.block_m), splits, num_reqs)
    _decode_partials_kernel[grid](
        q_nope,
        q_pe,
        cache,
        block_table,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        out,
        heads,
        latent,
        rope_dim,
        sliding_window or 0,
        config.split_size,
        scale * LOG2E,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        PAGE=cache.shape[1],
        HAS_WINDOW=sliding_window is not None,
        DIRECT=direct,
        FIXED_SPLITS=fixed,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_L=block_pow2(latent),
        BLOCK_R=block_pow2(rope_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if fixed:
        _combine_splits_in_order_kernel[(tokens * heads,)](
            part_out,
            part_lse,
            out,
            heads,
            latent,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            BLOCK_L=pow2(latent),
            num_warps=4,
        )
    elif not direct:
        _combine_splits_kernel[(tokens * heads,)](
            part_out,
            part_lse,
            out,
            heads,
            latent,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            BLOCK_S=pow2(splits),
            BLOCK_L=pow2(latent),
            num_warps=4,
        )
    return out


def _prepare(q_nope: Tensor, q_pe: Tensor, kv_cache: Sequence[Tensor], *others: Tensor):
    cache = cache_rows(kv_cache)
    device = check_device(q_nope, q_pe, cache, *others)
    return (
        q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous(),
        q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous(),
        cache,
        device,
    )


@OPS.implement
def mla_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Sequence[Tensor],
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """q_nope: [T, H, L], q_pe: [T, H, R] (unit stride along the last dim); kv_cache: (the
    [num_blocks, 64, L + R] cache,); block_table: [B, M] int32; seq_lens: [B] int32 (including the new
    tokens); query_start_loc: [B+1] int32. Returns a new [T, H, L] in q_nope's dtype."""
    q_nope, q_pe, cache, device = _prepare(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc)
    config = decode_config(
        device_limits(device),
        cache.element_size(),
        seq_lens.shape[0],
        max_query_len * q_nope.shape[1],
        block_table.shape[1] * cache.shape[1],
        cache.shape[2],
    )
    return launch_decode(
        q_nope,
        q_pe,
        cache,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
        sliding_window,
        config,
    )


@OPS.implement_invariant(
    f"splits at fixed key positions (every {INVARIANT_SPLIT}), one BLOCK_M per dtype whatever the query "
    "count, splits merged one after another in position order"
)
def mla_decode(  # noqa: F811 (the deterministic-mode variant)
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Sequence[Tensor],
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    q_nope, q_pe, cache, device = _prepare(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc)
    config = invariant_config(
        device_limits(device), cache.element_size(), block_table.shape[1] * cache.shape[1], cache.shape[2]
    )
    return launch_decode(
        q_nope,
        q_pe,
        cache,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
        sliding_window,
        config,
    )
