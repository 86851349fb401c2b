"""build.sh refuses what it cannot build with a message naming what is missing, before touching .venv."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import REPO_ROOT


def run_build(accelerator: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")}
    env["DEEPINFER_ACCELERATOR"] = accelerator
    return subprocess.run(
        ["bash", str(REPO_ROOT / "build.sh")], env=env, capture_output=True, text=True, timeout=60
    )


def test_ascend_without_cann_names_cann_and_leaves_the_cpu_setup_working() -> None:
    stamps = REPO_ROOT / ".venv" / ".deepinfer-stamps"
    before = {p.name: p.read_text() for p in stamps.iterdir()} if stamps.is_dir() else {}
    proc = run_build("ascend")
    assert proc.returncode == 3
    assert "needs CANN" in proc.stderr and "ASCEND_HOME_PATH" in proc.stderr and "set_env.sh" in proc.stderr
    after = {p.name: p.read_text() for p in stamps.iterdir()} if stamps.is_dir() else {}
    assert after == before
    check = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", "import torch, deepinfer.backends.ops"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_unknown_accelerator_lists_the_choices() -> None:
    proc = run_build("bogus")
    assert proc.returncode == 2
    assert "choose one of: auto, cpu, nvidia, ascend" in proc.stderr
