"""Every ops_cuda kernel compiles for SM80, SM90 and SM100 with the launch configuration its op picks at
DeepSeek-V3 shapes, and fits the shared memory of that architecture (see compile_check.py)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton")

import deepinfer.ops_cuda


def _all_kernels() -> set[str]:
    names = set()
    for name in deepinfer.ops_cuda.__all__:
        module = getattr(deepinfer.ops_cuda, name)
        if inspect.ismodule(module):
            names |= {k for k, v in vars(module).items() if k.endswith("_kernel") and hasattr(v, "fn")}
    return names


def _compile(arch: int, dtype: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.nvidia.compile_check", "--arch", str(arch), "--dtype", dtype],
        cwd=REPO_ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        (90, "bfloat16"),
        pytest.param(80, "bfloat16", marks=pytest.mark.slow),
        pytest.param(100, "bfloat16", marks=pytest.mark.slow),
        pytest.param(80, "float32", marks=pytest.mark.slow),
    ],
)
def test_kernels_compile_and_fit_shared_memory(arch: int, dtype: str) -> None:
    reports = _compile(arch, dtype)
    assert {r["kernel"] for r in reports} == _all_kernels()
    for r in reports:
        assert r["shared"] <= r["shared_limit"], r
