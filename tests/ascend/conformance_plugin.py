"""pytest plugin that runs a session against the torch_npu emulation.

``python -m pytest -p tests.ascend.conformance_plugin --pyargs deepinfer.backends.testing`` with
``DEEPINFER_CONFORMANCE_BACKEND=deepinfer.ops_ascend`` runs the conformance suite on the Ascend backend,
its torch_npu calls served by ``tests.ascend.emulation`` (installed before collection, removed at exit).
"""

from __future__ import annotations

import pytest

from tests.ascend import emulation


def pytest_configure(config: pytest.Config) -> None:
    emulation.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    emulation.uninstall()
