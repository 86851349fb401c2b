"""The fast CPU backend's paged latent cache: the reference layout, written by one native pass.

One tensor per layer, [num_blocks, 16, L + R] (latent then rope per token): ``mla_decode`` reads a row
as one contiguous L + R vector, so keeping latent and rope together is what the kernel wants, and the
shared layout lets the conformance suite and the prefix cache treat both CPU backends alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import KVCacheSpec
from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load
from deepinfer.backends.reference import cache as reference_cache

_native = load()


@OPS.implement
def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    return reference_cache.kv_cache_spec(kv_lora_rank, qk_rope_head_dim, dtype)


@OPS.implement
def kv_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Sequence[Tensor], slot_mapping: Tensor) -> None:
    (cache,) = kv_cache
    _native.kv_cache_write(kv_c, k_pe, cache, slot_mapping)
