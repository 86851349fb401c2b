"""Fixtures of the conformance suite: the backend under test, from DEEPINFER_ACCELERATOR."""

from __future__ import annotations

import pytest

from deepinfer.backends.testing.harness import Target, target_from_env


@pytest.fixture(scope="session")
def target() -> Target:
    return target_from_env()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """DEEPINFER_CONFORMANCE_SHAPES=small skips the DeepSeek-V3-shape cases."""
    from deepinfer import envs

    shapes = envs.get("DEEPINFER_CONFORMANCE_SHAPES")
    if shapes not in ("all", "small"):
        raise pytest.UsageError(f"DEEPINFER_CONFORMANCE_SHAPES={shapes!r}; choose 'all' or 'small'")
    if shapes == "small":
        skip = pytest.mark.skip(reason="DEEPINFER_CONFORMANCE_SHAPES=small")
        for item in items:
            if "deepseek_v3" in item.nodeid or "7168" in item.nodeid or "2048" in item.nodeid:
                item.add_marker(skip)
