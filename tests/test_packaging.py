"""A wheel built from the repo holds every module and works from another directory."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_python

MAPPED = {"backends": "deepinfer/backends", "ops_cuda": "deepinfer/ops_cuda", "ops_ascend": "deepinfer/ops_ascend",
          "platform": "deepinfer/platform", "deepinfer": "deepinfer"}  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO_ROOT),
         "-w", str(out)],
        check=True, capture_output=True, cwd=build,
    )  # fmt: skip
    (whl,) = out.glob("deepinfer-*.whl")
    return whl


def test_wheel_contains_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, target in MAPPED.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            rel = path.relative_to(REPO_ROOT / folder).as_posix()
            expected.add(f"{target}/{rel}")
    missing = sorted(expected - names)
    assert not missing, f"missing from the wheel (add the package to pyproject's packages list): {missing}"
    bundled = REPO_ROOT / "deepinfer" / "models"
    files = {
        f"deepinfer/models/{p.relative_to(bundled).as_posix()}" for p in bundled.rglob("*") if p.is_file()
    }
    assert "deepinfer/models/deepinfer-tiny-coder/confidence_head/model.safetensors" in files
    assert not sorted(files - names), f"bundled model files missing from the wheel: {sorted(files - names)}"


def test_installed_wheel_works_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    code = (
        "import deepinfer, deepinfer.backends.ops as ops, torch\n"
        f"assert deepinfer.__file__.startswith({str(target)!r}), deepinfer.__file__\n"
        "x = torch.randn(3, 8)\n"
        "print(ops.rms_norm(x, torch.ones(8), 1e-6).shape)\n"
    )
    proc = run_python(code, cwd=tmp_path, env={"PYTHONPATH": str(target), "DEEPINFER_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "torch.Size([3, 8])" in proc.stdout
