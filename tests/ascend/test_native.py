"""Choosing the sampling path: the Ascend C kernel only when it loads and draws the reference's tokens;
otherwise the torch path, and the log says which and why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deepinfer.backends.reference import sampling as reference
from deepinfer.ops_ascend import native

CPU = torch.device("cpu")


@pytest.fixture
def caplog_deepinfer(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="deepinfer")
    return caplog


def test_a_kernel_that_matches_the_reference_passes() -> None:
    assert native.self_test(reference.sample, CPU) is None


def test_a_kernel_that_draws_other_tokens_fails() -> None:
    def greedy_only(logits, *rest):
        return logits.argmax(-1)

    assert "drew different tokens" in native.self_test(greedy_only, CPU)


def test_a_kernel_that_raises_or_returns_int32_fails() -> None:
    def broken(*args):
        raise RuntimeError("aclnn error 561002")

    assert "raised RuntimeError" in native.self_test(broken, CPU)
    assert "int32" in native.self_test(lambda *a: reference.sample(*a).int(), CPU)


def test_the_self_test_batch_has_ties_at_the_filter_boundaries() -> None:
    logits, temperature, top_k, top_p, *_ = native.self_test_batch(CPU)
    assert bool((logits[:, 100:140] == logits[:, 100:101]).all())
    assert bool((temperature == 0).any()) and bool((top_k > 0).any()) and bool((top_p < 1).any())


def test_missing_library_uses_the_torch_path(tmp_path: Path, caplog_deepinfer) -> None:
    assert native.load_sampling_kernel(tmp_path / "libdeepinfer_ascend_ops.so", CPU) is None
    assert "not built" in caplog_deepinfer.text


def test_unloadable_library_uses_the_torch_path(tmp_path: Path, caplog_deepinfer) -> None:
    library = tmp_path / "libdeepinfer_ascend_ops.so"
    library.write_bytes(b"not an ELF file")
    assert native.load_sampling_kernel(library, CPU) is None
    assert "did not load" in caplog_deepinfer.text


def test_non_npu_devices_use_the_torch_path(caplog_deepinfer) -> None:
    native.sampling_kernel.cache_clear()
    assert native.sampling_kernel(CPU) is None
    assert "not an NPU" in caplog_deepinfer.text
