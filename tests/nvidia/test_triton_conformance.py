"""The conformance suite passes for deepinfer.ops_cuda, and fails when one of its kernels is broken.

Without a GPU the kernels run in Triton's interpreter (float32 and float16: the interpreter mishandles
bfloat16); on a GPU they run compiled, bfloat16 included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from deepinfer.backends.registry import PORTABLE_OPS, interface_ops
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA
from tests.conftest import REPO_ROOT
from tests.nvidia.conftest import DEVICE

triton = pytest.importorskip("triton")
tl = triton.language

ON_GPU = DEVICE.type == "cuda"
# the whole suite in Triton's interpreter takes minutes on 2 cores: a slow test there (CI runs it too)
slow_in_interpreter = pytest.mark.slow if not ON_GPU else pytest.mark.usefixtures()


def test_every_op_is_implemented_here(cuda_ops) -> None:
    """No op runs the reference implementation, except portable ops added since (which may)."""
    assert set(cuda_ops.reference_fallbacks) <= PORTABLE_OPS
    for name in set(interface_ops()) - set(cuda_ops.reference_fallbacks):
        assert cuda_ops.implementation(name).__module__.startswith("deepinfer.ops_cuda."), name


@slow_in_interpreter
def test_conformance_suite_passes(tmp_path: Path) -> None:
    """The whole suite (small and DeepSeek-V3 attention shapes; MoE sizes reduced) in a subprocess,
    run the way a vendor runs it; about a minute in the interpreter on two cores. In the interpreter
    the batch-invariance checks run separately, smaller (test_invariance.py)."""
    report = tmp_path / "conformance.xml"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "DEEPINFER_CONFORMANCE_BACKEND": "deepinfer.ops_cuda",
        "DEEPINFER_CONFORMANCE_DEVICE": DEVICE.type,
        "DEEPINFER_CONFORMANCE_DTYPES": "float32,bfloat16,float16" if ON_GPU else "float32,float16",
        "DEEPINFER_CONFORMANCE_SHAPES": "all",
        "DEEPINFER_CONFORMANCE_FULL": "0",
        "OMP_NUM_THREADS": "1",
    }
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "deepinfer.backends.testing",
         f"--junitxml={report}", *([] if ON_GPU else ["-k", "not test_invariance"])],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("failures", "1")) == 0 and int(suite.get("errors", "1")) == 0
    ran = [c for c in suite.iter("testcase") if c.find("skipped") is None]
    assert len(ran) >= (100 if ON_GPU else 70), len(ran)
    ran_names = {c.get("name", "").split("[")[0] for c in ran}
    assert {
        "test_mla_decode",
        "test_mla_prefill",
        "test_fused_moe",
        "test_sample",
        "test_moe_route",
    } <= ran_names
    assert any("deepseek_v3" in c.get("name", "") for c in ran if "mla_decode" in c.get("name", ""))


def test_shifted_block_table_entry_fails(cuda_ops) -> None:
    args = (cuda_ops, DEVICE, torch.float32, SMALL_MLA, [1, 1, 1, 1], None)
    checks.check_mla_decode(*args, "shift")
    with pytest.raises(AssertionError, match="mla_decode"):
        checks.check_mla_decode(*args, "shift", corrupt_block_table=True)


@triton.jit
def _average_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, H, L, stride_o_t, stride_o_h,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """A classic split-KV bug: merging the splits by a plain average instead of by their softmax mass."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    cl = tl.arange(0, BLOCK_L)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    weight = tl.where(lse > float("-inf"), 1.0, 0.0)
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s)[:, None] * L + cl[None, :],
        mask=(s < NUM_SPLITS)[:, None] & (cl < L)[None, :],
        other=0.0,
    )
    o = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + (row // H) * stride_o_t + (row % H) * stride_o_h + cl,
        o.to(out_ptr.dtype.element_ty),
        mask=cl < L,
    )


def test_split_merge_that_ignores_the_softmax_mass_fails(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.ops_cuda import mla_decode
    from deepinfer.ops_cuda.runtime import device_limits

    # The check's batch (4 requests, up to 130 tokens) is split, so the merge kernel runs.
    config = mla_decode.decode_config(device_limits(DEVICE), 4, 4, SMALL_MLA.heads, 3 * 64, 48)
    assert config.num_splits > 1
    args = (cuda_ops, DEVICE, torch.float32, SMALL_MLA, [1, 2, 1, 3], None, "merge")
    checks.check_mla_decode(*args)
    monkeypatch.setattr(mla_decode, "_combine_splits_kernel", _average_splits_kernel)
    with pytest.raises(AssertionError, match=r"mla_decode.*relative error"):
        checks.check_mla_decode(*args)
