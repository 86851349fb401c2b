"""The Triton sampler at extreme but valid parameter values: only tokens with non-zero probability,
greedy where a temperature or top_p underflows float32 (through the interpreter on a CPU host)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from deepinfer.backends import ops
from deepinfer.backends.registry import set_active_ops
from tests.backends.sampling_support import assert_tokens_in_support, sampling_batches
from tests.nvidia.conftest import DEVICE

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tables(cuda_ops):
    """The op table in a tuple: hypothesis probes a test's arguments with getattr, which an OpTable
    answers with MissingOpError."""
    return (cuda_ops,)


@settings(max_examples=12, deadline=None)
@given(batch=sampling_batches(max_rows=3, max_vocab=80))
def test_triton_samples_only_supported_tokens(tables, batch) -> None:
    set_active_ops(tables[0])
    assert_tokens_in_support(batch, ops.sample(*(t.to(DEVICE) for t in batch)))
