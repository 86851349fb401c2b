"""Tests of the NVIDIA backend: on a CUDA GPU when there is one, else through Triton's interpreter.

Triton decides at kernel-definition time whether kernels are interpreted, so on a host without a GPU
``TRITON_INTERPRET=1`` is set here, at collection, before any test imports ``deepinfer.ops_cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def cuda_ops():
    """The finalised ops_cuda table; fails clearly if its kernels cannot run on this host."""
    pytest.importorskip("triton")
    from deepinfer.backends.registry import load_backend
    from deepinfer.ops_cuda import norm

    if DEVICE.type == "cpu" and type(norm._rms_norm_kernel).__name__ != "InterpretedFunction":
        pytest.fail(
            "deepinfer.ops_cuda was imported before TRITON_INTERPRET=1 was set; its kernels are compiled"
        )
    return load_backend("deepinfer.ops_cuda")
