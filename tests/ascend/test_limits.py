"""Where a documented kernel limit bites, the backend raises a clear error instead of computing
something else."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.registry import OpTable
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA, MLAShape

CPU = torch.device("cpu")


def test_float32_attention_is_refused(ascend_ops: OpTable) -> None:
    with pytest.raises(TypeError, match="float16/bfloat16 only"):
        checks.check_mla_prefill(ascend_ops, CPU, torch.float32, SMALL_MLA, None, "fp32-prefill")
    with pytest.raises(TypeError, match="float16/bfloat16 only"):
        checks.check_mla_decode(ascend_ops, CPU, torch.float32, SMALL_MLA, [1, 1, 1, 1], None, "fp32-decode")


def test_more_than_sixteen_queries_per_request_are_refused(ascend_ops: OpTable) -> None:
    with pytest.raises(ValueError, match="at most 16"):
        checks.check_mla_decode(ascend_ops, CPU, torch.bfloat16, SMALL_MLA, [1, 17], None, "17-queries")


def test_more_than_128_decode_heads_are_refused(ascend_ops: OpTable) -> None:
    wide = MLAShape("wide", heads=129, kv_lora_rank=32, rope=16, nope=16, v=24)
    with pytest.raises(ValueError, match="at most 128"):
        checks.check_mla_decode(ascend_ops, CPU, torch.bfloat16, wide, [1, 1, 1, 1], None, "129-heads")


def test_non_power_of_two_heads_are_padded(ascend_ops: OpTable) -> None:
    odd = MLAShape("odd", heads=20, kv_lora_rank=32, rope=16, nope=16, v=24)
    checks.check_mla_decode(ascend_ops, CPU, torch.bfloat16, odd, [1, 3, 2, 4], None, "20-heads")


def test_routing_limits_are_named(ascend_ops: OpTable) -> None:
    logits = torch.randn(4, 4096)
    with pytest.raises(ValueError, match="at most 2048 experts"):
        ascend_ops.moe_route(logits, None, 8, 1, 1, "softmax", "greedy", False, 1.0)
