"""Deterministic mode on the Triton kernels: the fixed-tile GEMM / MoE kernels and the fixed-split
decode give a row the same bits alone and among batch mates (float32 and float16).

Without a GPU the kernels run in Triton's interpreter, which computes ``tl.dot`` with numpy's OpenBLAS.
OpenBLAS's Haswell sgemm kernel rounds a row differently depending on its position inside the matrix
(measured: rows 6-11 and 18-31 of a 32-row product), which is an artefact of the emulation, not of the
kernels (a GPU's MMA instructions compute each row alike); the interpreter run therefore pins OpenBLAS's
SandyBridge kernel (``OPENBLAS_CORETYPE``), which is row-position invariant. The batch mates are 1 and 7
here (the interpreter is slow); the full 1/7/31 runs on a GPU through the conformance suite.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO_ROOT, run_python
from tests.nvidia.conftest import DEVICE

pytest.importorskip("triton")

CHECKS = """
import torch
from deepinfer.backends.registry import load_backend
from deepinfer.backends.testing import invariance
from deepinfer.backends.testing.harness import SMALL_MLA
from deepinfer.backends.testing.test_invariance import ODD_MOE
invariance.MATES = (1, 7)
ops, device = load_backend("deepinfer.ops_cuda"), torch.device("{device}")
for dtype in (torch.float32, torch.float16):
    invariance.check_rowwise_small_ops(ops, device, dtype, 40, f"tri-rows-{{dtype}}")
    invariance.check_moe(ops, device, dtype, ODD_MOE, f"tri-moe-{{dtype}}")
    invariance.check_attention(ops, device, dtype, SMALL_MLA, None, f"tri-attn-{{dtype}}")
invariance.check_attention(ops, device, torch.float32, SMALL_MLA, 24, "tri-attn-window")
print("invariant")
"""


@pytest.mark.slow
def test_triton_kernels_are_batch_invariant_in_deterministic_mode() -> None:
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    if DEVICE.type == "cpu":
        env.update(TRITON_INTERPRET="1", OPENBLAS_CORETYPE="SandyBridge")
    proc = run_python(CHECKS.format(device=DEVICE.type), env={**os.environ, **env}, timeout=900)
    assert proc.returncode == 0 and "invariant" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
