"""Test-wide setup: every test runs on the CPU platform unless it chooses otherwise."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cpu_platform(monkeypatch: pytest.MonkeyPatch):
    """Pin DEEPINFER_ACCELERATOR=cpu and forget any platform or op table a previous test chose."""
    from deepinfer.backends.registry import set_active_ops
    from deepinfer.platform.registry import set_current_platform

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", os.environ.get("DEEPINFER_TEST_ACCELERATOR", "cpu"))
    set_current_platform(None)
    set_active_ops(None)
    yield
    set_current_platform(None)
    set_active_ops(None)


def run_python(code: str, cwd: Path | str = REPO_ROOT, env: dict[str, str] | None = None, timeout: int = 120):
    """Run ``python -c code`` in a subprocess with this interpreter; returns CompletedProcess."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
