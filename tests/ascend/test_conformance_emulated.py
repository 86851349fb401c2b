"""The backend conformance suite, run on the whole Ascend backend with its torch_npu calls emulated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.ascend.conftest import ON_ASCEND
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(ON_ASCEND, reason="on an NPU, ci/ascend.sh runs the suite on the device")


def run_suite(dtypes: str, *selection: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DEEPINFER_CONFORMANCE_BACKEND": "deepinfer.ops_ascend",
        "DEEPINFER_CONFORMANCE_DEVICE": "cpu",
        "DEEPINFER_CONFORMANCE_DTYPES": dtypes,
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.ascend.conformance_plugin",
        "--pyargs",
        "deepinfer.backends.testing",
        *selection,
    ]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_conformance_in_half_precision() -> None:
    """Every op at small and DeepSeek-V3 shapes; attention runs in bfloat16 / float16 only on Ascend."""
    proc = run_suite("bfloat16,float16")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_conformance_in_float32_except_attention() -> None:
    """The ops that take float32 on the NPU (attention raises; see test_limits.py)."""
    proc = run_suite("float32", "-k", "not mla_ and not test_attention")  # invariance's attention too
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
