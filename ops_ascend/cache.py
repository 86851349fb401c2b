"""The paged MLA cache on Ascend: two tensors per layer, written with ``npu_scatter_pa_kv_cache``.

Layout (``kv_cache_spec``): block size 128 (the size the FIA MLA kernel and vllm-ascend use; FIA MLA
accepts 16 or 128), and per layer

- ``latent`` [num_blocks, 128, 1, L]: the normalised latent of each token;
- ``rope``   [num_blocks, 128, 1, R]: its rotated rope key, in the interface's layout (interleaved pairs
  for DeepSeek; this backend's rope op keeps that layout, so no reader permutes it).

``[nb, 128, 1, D]`` is the ND layout ``npu_scatter_pa_kv_cache`` writes with ``cache_mode='Norm'``
(key_cache [num_blocks, block_size, num_head, head_size]); with one head it is bit-for-bit the BnNBsD
layout ``[nb, 1, 128, D]`` the FIA MLA kernel reads, so decode passes a view, never a copy. The widths are
stored as the model has them; ``mla_decode`` pads non-DeepSeek widths (anything but 512 + 64) itself.

``kv_cache_write`` passes the latent as the op's "key" and the rope as its "value" (the doc allows
different key and value head sizes) with ``cache_mode='Norm'`` (the op's default is 'PA_NZ', the fractal
layout, which this cache is not). The op requires slots in ``[0, num_blocks * block_size)``, so padding
tokens (negative slots) are dropped first; the decision uses the step's host copy of the slots (one copy
per step, shared by all layers). ``kv_cache_gather`` is a row gather (``index_select``) on the flat views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import CacheTensorSpec, KVCacheSpec
from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.host import host_list
from deepinfer.ops_ascend.npu import torch_npu

BLOCK_SIZE = 128


@OPS.implement
def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(
        block_size=BLOCK_SIZE,
        tensors=(
            CacheTensorSpec("latent", (BLOCK_SIZE, 1, kv_lora_rank)),
            CacheTensorSpec("rope", (BLOCK_SIZE, 1, qk_rope_head_dim)),
        ),
        dtype=dtype,
    )


def _written_rows(slot_mapping: Tensor) -> Tensor | None:
    """Indices of the tokens with a valid (non-negative) slot, or None when every token has one."""
    slots = host_list(slot_mapping)
    if not slots or min(slots) >= 0:
        return None
    return torch.tensor(
        [i for i, s in enumerate(slots) if s >= 0], dtype=torch.long, device=slot_mapping.device
    )


@OPS.implement
def kv_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Sequence[Tensor], slot_mapping: Tensor) -> None:
    latent, rope = kv_cache
    rows = _written_rows(slot_mapping)
    if rows is not None:
        if rows.numel() == 0:
            return
        kv_c, k_pe, slot_mapping = kv_c[rows], k_pe[rows], slot_mapping[rows]
    key = kv_c.to(latent.dtype).contiguous().unsqueeze(1)
    value = k_pe.to(rope.dtype).contiguous().unsqueeze(1)
    torch_npu().npu_scatter_pa_kv_cache(
        key, value, latent, rope, slot_mapping.contiguous(), cache_mode="Norm"
    )


@OPS.implement
def kv_cache_gather(
    kv_cache: Sequence[Tensor], slot_mapping: Tensor, kv_lora_rank: int
) -> tuple[Tensor, Tensor]:
    latent, rope = kv_cache
    if latent.shape[-1] != kv_lora_rank:
        raise ValueError(f"cache latent width {latent.shape[-1]} != kv_lora_rank {kv_lora_rank}")
    slots = slot_mapping.long()
    return (
        latent.view(-1, latent.shape[-1]).index_select(0, slots),
        rope.view(-1, rope.shape[-1]).index_select(0, slots),
    )
