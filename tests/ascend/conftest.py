"""Fixtures of the Ascend backend tests: the torch_npu emulation, installed per module and removed after
(other test packages check that torch_npu is absent), and the backend's op table."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from deepinfer.backends.registry import OpTable, load_backend
from tests.ascend import emulation

ON_ASCEND = os.environ.get("DEEPINFER_TEST_ACCELERATOR") == "ascend"


@pytest.fixture(scope="module")
def npu_emulation() -> Iterator[None]:
    if ON_ASCEND:
        pytest.skip("the torch_npu emulation is for hosts without an NPU")
    emulation.install()
    yield
    emulation.uninstall()


@pytest.fixture
def ascend_ops(npu_emulation: None) -> OpTable:
    return load_backend("deepinfer.ops_ascend")
