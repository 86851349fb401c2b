"""Emulated ``npu_scatter_pa_kv_cache``, from its documentation (torch_npu 2.13.0).

Scenario 2 (3-D key/value): key [T, N, Dk] and value [T, N, Dv] with equal first two dimensions,
key_cache [num_blocks, block_size, N, Dk], value_cache [num_blocks, block_size, N, Dv] with
``cache_mode`` None or 'Norm' (ND). The DEFAULT ``cache_mode`` is 'PA_NZ': the caches are then read as the
fractal layout [num_blocks, N * D / 16, block_size, 16], and an ND cache fails that shape check. Inputs
contiguous, all four tensors of one dtype, slot_mapping int32/int64 with values in
[0, num_blocks * block_size) and no duplicates (the doc: "重复时不保证正确性"; emulated as an error).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tests.ascend.emulation.runtime import npu_op


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"npu_scatter_pa_kv_cache: {message}")


def _check_nz(cache: Tensor, heads: int, width: int) -> None:
    last = 32 // cache.element_size()
    expected = (heads * width // last, cache.shape[2], last) if cache.dim() == 4 else None
    _require(
        expected is not None and tuple(cache.shape[1:]) == expected,
        f"cache_mode 'PA_NZ' expects [blocks, {heads * width // last}, block_size, {last}], got {tuple(cache.shape)}",
    )


@npu_op
def npu_scatter_pa_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    compress_lens: Tensor | None = None,
    compress_seq_offsets: Tensor | None = None,
    seq_lens: Tensor | None = None,
    cache_mode: str | None = "PA_NZ",
) -> None:
    _require(
        compress_lens is None and compress_seq_offsets is None and seq_lens is None,
        "compression is not emulated",
    )
    _require(key.dim() == 3 and value.dim() == 3, "only 3-D key/value (scenarios 1 and 2) are emulated")
    _require(key.shape[:2] == value.shape[:2], "key and value share their first two dimensions")
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) == 1, "one dtype for all four")
    _require(
        slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == key.shape[:1],
        "slot_mapping is int32/int64 [tokens]",
    )
    tokens, heads = key.shape[:2]
    if cache_mode == "PA_NZ":
        _check_nz(key_cache, heads, key.shape[2])
        _check_nz(value_cache, heads, value.shape[2])
        raise NotImplementedError("writing the NZ layout is not emulated")
    _require(cache_mode in (None, "Norm"), f"cache_mode must be None, 'Norm' or 'PA_NZ', got {cache_mode!r}")
    for name, cache, src in (("key_cache", key_cache, key), ("value_cache", value_cache, value)):
        _require(
            cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(src.shape[1:]),
            f"ND {name} is [blocks, block_size, {src.shape[1]}, {src.shape[2]}], got {tuple(cache.shape)}",
        )
    _require(key_cache.shape[:2] == value_cache.shape[:2], "key and value caches have the same blocks")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    _require(bool(((slots >= 0) & (slots < capacity)).all()), f"slots must lie in [0, {capacity})")
    _require(slots.unique().numel() == tokens, "slots must not repeat")
    key_cache.view(capacity, heads, -1)[slots] = key
    value_cache.view(capacity, heads, -1)[slots] = value
