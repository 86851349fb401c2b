"""An out-of-tree platform installed as its own distribution is found through the entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, run_python

PLUGIN = REPO_ROOT / "tests" / "plugins" / "deepinfer_dummy_platform"


def test_registry_finds_and_activates_the_dummy_platform(tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(PLUGIN)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    code = """
import torch
from deepinfer.platform.registry import registered_platforms, current_platform
from deepinfer.backends import ops
from deepinfer.backends.registry import active_ops
import deepinfer_dummy_platform.ops as dummy_ops
assert registered_platforms()["dummy"] == "deepinfer_dummy_platform.platform:DummyPlatform"
platform = current_platform()
assert platform.name == "dummy" and platform.device_name == "dummy0", platform.describe()
out = ops.silu_and_mul(torch.randn(3, 8))
assert dummy_ops.CALLS == [(3, 8)], dummy_ops.CALLS
assert "silu_and_mul" not in active_ops().reference_fallbacks and "rms_norm" in active_ops().reference_fallbacks
print("ok", out.shape)
"""
    proc = run_python(
        code, cwd=tmp_path, env={"PYTHONPATH": f"{site}:{REPO_ROOT}", "DEEPINFER_ACCELERATOR": "dummy"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok torch.Size([3, 4])" in proc.stdout
    assert "op rms_norm runs the reference implementation (dummy backend)" in proc.stderr
