"""Choosing the sampling path: the Ascend C kernel only when it loads and draws the reference's tokens;
otherwise the torch path, with the reason; on that path the backend declares the reference fallback
through the op registry (a WARNING, listed by describe() and reference_fallbacks)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deepinfer.backends.reference import sampling as reference
from deepinfer.ops_ascend import native

CPU = torch.device("cpu")


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


def test_missing_library_uses_the_torch_path(tmp_path: Path) -> None:
    kernel, why = native.load_sampling_kernel(tmp_path / "libdeepinfer_ascend_ops.so", CPU)
    assert kernel is None and "not built" in why


def test_unloadable_library_uses_the_torch_path(tmp_path: Path) -> None:
    library = tmp_path / "libdeepinfer_ascend_ops.so"
    library.write_bytes(b"not an ELF file")
    kernel, why = native.load_sampling_kernel(library, CPU)
    assert kernel is None and "did not load" in why


def test_non_npu_devices_use_the_torch_path() -> None:
    native.sampling_kernel.cache_clear()
    kernel, why = native.sampling_kernel(CPU)
    assert kernel is None and "not an NPU" in why


def test_the_torch_path_is_a_declared_reference_fallback(
    ascend_ops, caplog: pytest.LogCaptureFixture
) -> None:
    native.sampling_kernel.cache_clear()
    batch = native.self_test_batch(CPU)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        tokens = ascend_ops.sample(*batch)
        ascend_ops.sample(*batch)
    assert torch.equal(tokens, reference.sample(*batch))
    warnings = [r for r in caplog.records if "runs the reference implementation" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once, not per step
    assert "backend deepinfer.ops_ascend: op sample" in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.levelno < logging.WARNING and "sampling" in r.getMessage()]
    assert "not an NPU" in ascend_ops.reference_fallbacks["sample"]
    assert "sample (device cpu is not an NPU)" in ascend_ops.describe()
