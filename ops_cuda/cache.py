"""The paged MLA cache in FlashMLA's layout: one tensor per layer, [num_blocks, 64, L + R], each row the
normalised latent followed by the rotated rope key (the decode kernel reads a whole row as the key and
its first L values as the value)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.backends.cache_spec import CacheTensorSpec, KVCacheSpec
from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2

BLOCK_SIZE = 64


def cache_rows(kv_cache: Sequence[Tensor]) -> Tensor:
    """This layer's single cache tensor, checked to be the contiguous [num_blocks, 64, L + R] layout."""
    (cache,) = kv_cache
    if cache.dim() != 3 or cache.shape[1] != BLOCK_SIZE or not cache.is_contiguous():
        raise ValueError(
            f"expected a contiguous [num_blocks, {BLOCK_SIZE}, L + R] cache, got {tuple(cache.shape)}"
        )
    return cache


@triton.jit
def _copy_row_part(src_ptr, dst_ptr, width, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cache_write_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_ptr,
    L,
    R,
    stride_c,
    stride_pe,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + slot * (L + R)
        _copy_row_part(kv_c_ptr + t * stride_c, row, L, BLOCK_L)
        _copy_row_part(k_pe_ptr + t * stride_pe, row + L, R, BLOCK_R)


@triton.jit
def _cache_gather_kernel(
    cache_ptr, slot_ptr, kv_c_ptr, k_pe_ptr, L, R, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    row = cache_ptr + tl.load(slot_ptr + n).to(tl.int64) * (L + R)
    _copy_row_part(row, kv_c_ptr + n * L, L, BLOCK_L)
    _copy_row_part(row + L, k_pe_ptr + n * R, R, BLOCK_R)


@OPS.implement
def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    """64-token blocks of one (L + R)-wide row per token, latent then rope (FlashMLA's layout)."""
    return KVCacheSpec(
        block_size=BLOCK_SIZE,
        tensors=(CacheTensorSpec("latent_rope", (BLOCK_SIZE, kv_lora_rank + qk_rope_head_dim)),),
        dtype=dtype,
    )


@OPS.implement
def kv_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Sequence[Tensor], slot_mapping: Tensor) -> None:
    """kv_c: [T, L]; k_pe: [T, R] (unit stride along the row); slot_mapping: [T] int64, negative =
    skip. Writes cache rows in place, cast to the cache dtype."""
    cache = cache_rows(kv_cache)
    check_device(kv_c, k_pe, cache, slot_mapping)
    latent, rope_dim = kv_c.shape[1], k_pe.shape[1]
    if kv_c.stride(-1) != 1:
        kv_c = kv_c.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    if slot_mapping.numel():
        _cache_write_kernel[(slot_mapping.numel(),)](
            kv_c,
            k_pe,
            cache,
            slot_mapping,
            latent,
            rope_dim,
            kv_c.stride(0),
            k_pe.stride(0),
            BLOCK_L=pow2(latent),
            BLOCK_R=pow2(rope_dim),
            num_warps=4,
        )


@OPS.implement
def kv_cache_gather(
    kv_cache: Sequence[Tensor], slot_mapping: Tensor, kv_lora_rank: int
) -> tuple[Tensor, Tensor]:
    """slot_mapping: [N] int64 of valid slots. Returns new ``(kv_c [N, L], k_pe [N, R])`` in the cache
    dtype, in slot order."""
    cache = cache_rows(kv_cache)
    check_device(cache, slot_mapping)
    rope_dim = cache.shape[2] - kv_lora_rank
    n = slot_mapping.numel()
    kv_c = torch.empty((n, kv_lora_rank), dtype=cache.dtype, device=cache.device)
    k_pe = torch.empty((n, rope_dim), dtype=cache.dtype, device=cache.device)
    if n:
        _cache_gather_kernel[(n,)](
            cache,
            slot_mapping,
            kv_c,
            k_pe,
            kv_lora_rank,
            rope_dim,
            BLOCK_L=pow2(kv_lora_rank),
            BLOCK_R=pow2(rope_dim),
            num_warps=4,
        )
    return kv_c, k_pe
