"""The Ascend sampler path at extreme but valid parameter values: only tokens with non-zero
probability, greedy where a temperature or top_p underflows float32 (on the torch_npu emulation)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from deepinfer.backends import ops
from deepinfer.backends.registry import load_backend, set_active_ops
from tests.backends.sampling_support import assert_tokens_in_support, sampling_batches


@pytest.fixture(scope="module")
def tables(npu_emulation):
    """The op table in a tuple: hypothesis probes a test's arguments with getattr, which an OpTable
    answers with MissingOpError."""
    return (load_backend("deepinfer.ops_ascend"),)


@settings(max_examples=40, deadline=None)
@given(batch=sampling_batches())
def test_ascend_samples_only_supported_tokens(tables, batch) -> None:
    set_active_ops(tables[0])
    assert_tokens_in_support(batch, ops.sample(*batch))
