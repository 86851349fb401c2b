"""The op registry: duplicates, signatures, completeness, declared reference fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.backends import ops
from deepinfer.backends.registry import (
    DuplicateOpError,
    MissingOpError,
    OpTable,
    activate,
    active_ops,
    interface_ops,
    load_backend,
)
from deepinfer.platform.registry import resolve_platform


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x


def test_interface_lists_every_op_of_the_issue() -> None:
    assert set(interface_ops()) >= {
        "mla_prefill", "mla_decode", "kv_cache_write", "kv_cache_spec", "moe_route", "grouped_gemm",
        "fused_moe", "ep_dispatch", "ep_combine", "sample", "rms_norm", "add_rms_norm", "rope",
        "silu_and_mul",
    }  # fmt: skip


def test_duplicate_op_raises() -> None:
    table = OpTable("t")
    table.implement(silu_and_mul)
    with pytest.raises(DuplicateOpError, match="silu_and_mul"):
        table.implement(silu_and_mul)


def test_signature_must_match_the_interface() -> None:
    def rms_norm(x, w, eps):  # parameter named w, interface says weight
        return x

    with pytest.raises(TypeError, match=r"rms_norm\(x, w, eps\) does not match"):
        OpTable("t").implement(rms_norm)


def test_unknown_op_name_raises() -> None:
    def flash_attention(q):
        return q

    with pytest.raises(ValueError, match="not an interface op"):
        OpTable("t").implement(flash_attention)


def test_missing_ops_are_named_at_finalize() -> None:
    table = OpTable("partial")
    table.implement(silu_and_mul)
    table.use_reference_for(sorted(set(interface_ops()) - {"silu_and_mul", "mla_decode", "sample"}), "test")
    with pytest.raises(MissingOpError, match="does not implement: mla_decode, sample"):
        table.finalize()


def test_declared_fallbacks_run_the_reference_and_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    table = OpTable("fallback-test")
    table.implement(silu_and_mul)
    table.use_reference_for(sorted(set(interface_ops()) - {"silu_and_mul"}), "not written yet")
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        table.finalize()
    assert (
        "backend fallback-test: op rms_norm runs the reference implementation (not written yet)"
        in caplog.text
    )
    reference = load_backend("deepinfer.backends.reference")
    assert table.rms_norm is reference.rms_norm
    assert table.silu_and_mul is silu_and_mul


def test_runtime_fallbacks_are_warned_once_and_described(caplog: pytest.LogCaptureFixture) -> None:
    table = OpTable("runtime-test")
    table.implement(silu_and_mul)
    table.use_reference_for(sorted(set(interface_ops()) - {"silu_and_mul"}), "not written yet")
    table.finalize()
    assert "silu_and_mul" not in table.reference_fallbacks
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        for _ in range(3):
            table.fallback_at_runtime("silu_and_mul", "kernel not built")
    assert caplog.text.count("op silu_and_mul runs the reference implementation (kernel not built)") == 1
    assert table.reference_fallbacks["silu_and_mul"] == "kernel not built"
    assert "silu_and_mul (kernel not built)" in table.describe()
    with pytest.raises(ValueError, match="not an op this backend implements"):
        OpTable("empty").fallback_at_runtime("rms_norm", "x")


def test_dispatch_goes_to_the_active_backend() -> None:
    platform = resolve_platform("cpu")
    activate(platform)
    assert active_ops().backend == platform.op_backend == "deepinfer.backends.cpu.backend"
    x = torch.randn(2, 6)
    torch.testing.assert_close(
        ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :3]) * x[:, 3:], rtol=1e-6, atol=1e-7
    )


def test_vendor_backends_declare_every_op_they_do_not_implement_yet() -> None:
    for module in ("deepinfer.ops_cuda", "deepinfer.ops_ascend"):
        table = load_backend(module)
        for name in interface_ops():
            table.implementation(name)  # complete: every op resolves
