"""The paged KV-cache layout a backend asks for.

The layout belongs to the backend (FlashMLA wants 64-token blocks of one 576-wide row per token; the
Ascend ops want 128-token blocks with separate latent and rope tensors). The engine asks the active
backend for a ``KVCacheSpec`` through the ``kv_cache_spec`` op, allocates ``num_blocks`` blocks per
layer with ``allocate``, and from then on handles only block ids and slot numbers
(``slot = block_id * block_size + offset_in_block``). Only the backend's own ops read or write the
tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CacheTensorSpec:
    """One tensor of a layer's cache: ``name`` and the shape of ONE block (block_size included)."""

    name: str
    block_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Per-layer cache layout: every layer holds ``len(tensors)`` tensors of shape
    ``(num_blocks, *block_shape)`` and dtype ``dtype``."""

    block_size: int
    tensors: tuple[CacheTensorSpec, ...]
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        """Bytes one block takes in one layer, over all of its tensors."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(t.block_shape) for t in self.tensors) * itemsize

    def allocate(self, num_blocks: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Allocate one layer's cache tensors (uninitialised: unwritten slots are never read)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        return tuple(
            torch.empty((num_blocks, *t.block_shape), dtype=self.dtype, device=device) for t in self.tensors
        )
