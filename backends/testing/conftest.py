"""Fixtures of the conformance suite: the backend under test, from DEEPINFER_ACCELERATOR."""

from __future__ import annotations

import pytest

from deepinfer.backends.testing.harness import Target, target_from_env


@pytest.fixture(scope="session")
def target() -> Target:
    return target_from_env()
