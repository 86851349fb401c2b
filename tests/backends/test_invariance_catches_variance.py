"""The batch-invariance checks fail on ops that are not batch-invariant: the reference's default
(fast) linear and mla_decode, wrongly declared invariant, are caught."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.reference import attention, linear
from deepinfer.backends.registry import OpTable, interface_ops
from deepinfer.backends.testing import invariance
from deepinfer.backends.testing.harness import MLAShape

# One head: the alone query is a single row, which MKL computes with another kernel than a chunk's rows.
ONE_HEAD = MLAShape("one-head", heads=1, kv_lora_rank=32, rope=16, nope=16, v=24)


def _wrongly_declared() -> OpTable:
    table = OpTable("claims-too-much")
    table.implement(linear.linear)
    table.implement(attention.mla_decode)
    table.declare_invariant(["linear", "mla_decode"], "claimed without reason")
    table.use_reference_for(sorted(set(interface_ops()) - {"linear", "mla_decode"}), "test")
    return table.finalize()


def test_default_linear_is_caught() -> None:
    with pytest.raises(AssertionError, match=r"linear\.out0: not batch-invariant"):
        invariance.check_rowwise_small_ops(
            _wrongly_declared(), torch.device("cpu"), torch.float32, 64, "catch-linear"
        )


def test_default_decode_is_caught() -> None:
    with pytest.raises(AssertionError, match="mla_decode: not batch-invariant"):
        invariance.check_attention(
            _wrongly_declared(), torch.device("cpu"), torch.float32, ONE_HEAD, None, "catch-decode"
        )


def test_an_undeclared_op_of_the_backend_layout_blocks_deterministic_mode() -> None:
    """A backend with its own cache layout must make mla_decode invariant itself: no silent routing."""
    from deepinfer.backends.cache_spec import CacheTensorSpec, KVCacheSpec
    from deepinfer.backends.registry import MissingOpError

    def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(64, (CacheTensorSpec("rows", (64, kv_lora_rank + qk_rope_head_dim)),), dtype)

    table = OpTable("own-layout")
    table.implement(kv_cache_spec)
    table.implement(attention.mla_decode)
    table.use_reference_for(sorted(set(interface_ops()) - {"kv_cache_spec", "mla_decode"}), "test")
    with pytest.raises(MissingOpError, match=r"reads the backend.s own KV-cache layout"):
        table.set_deterministic(True)
