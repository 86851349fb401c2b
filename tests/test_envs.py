"""Every DEEPINFER_* variable the project reads is declared once in deepinfer/envs.py."""

from __future__ import annotations

import re

import pytest

from deepinfer import envs
from tests.conftest import REPO_ROOT

SOURCES = ["deepinfer", "backends", "platform", "ops_cuda", "ops_ascend", "ci", "build.sh", ".ci", "tests"]


def test_every_variable_used_is_declared() -> None:
    used: set[str] = set()
    for root in SOURCES:
        path = REPO_ROOT / root
        files = [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.sh"), *path.rglob("run")]
        for file in files:
            used |= set(re.findall(r"\bDEEPINFER_[A-Z0-9_]*[A-Z0-9]\b", file.read_text()))
    undeclared = sorted(used - set(envs.ENV_VARS))
    assert not undeclared, f"declare these in deepinfer/envs.py: {undeclared}"


def test_reading_values_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_MALLOC_TUNING", "no")
    assert envs.get("DEEPINFER_MALLOC_TUNING") is False
    monkeypatch.setenv("DEEPINFER_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="DEEPINFER_NUM_THREADS='two' is invalid"):
        envs.get("DEEPINFER_NUM_THREADS")
    with pytest.raises(KeyError, match="not a declared"):
        envs.get("DEEPINFER_" + "NOPE")  # built so the scan above does not see it
