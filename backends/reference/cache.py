"""Reference paged latent cache: one tensor per layer, [num_blocks, 16, L + R] (latent then rope)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import CacheTensorSpec, KVCacheSpec
from deepinfer.backends.reference import OPS

BLOCK_SIZE = 16


@OPS.implement
def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(
        block_size=BLOCK_SIZE,
        tensors=(CacheTensorSpec("latent_rope", (BLOCK_SIZE, kv_lora_rank + qk_rope_head_dim)),),
        dtype=dtype,
    )


def _rows(kv_cache: Sequence[Tensor]) -> Tensor:
    (cache,) = kv_cache
    return cache.view(-1, cache.shape[-1])


@OPS.implement
def kv_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Sequence[Tensor], slot_mapping: Tensor) -> None:
    rows = _rows(kv_cache)
    new = torch.cat((kv_c, k_pe), dim=-1).to(rows.dtype)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, new = slots[valid], new[valid]
    rows.index_copy_(0, slots, new)


@OPS.implement
def kv_cache_gather(
    kv_cache: Sequence[Tensor], slot_mapping: Tensor, kv_lora_rank: int
) -> tuple[Tensor, Tensor]:
    rows = _rows(kv_cache).index_select(0, slot_mapping.long())
    return rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
