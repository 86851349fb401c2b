"""The package layout holds in the three ways it is used: from the repo root, under pytest, installed."""

from __future__ import annotations

import sys

from tests.conftest import REPO_ROOT, run_python


def test_platform_folder_does_not_shadow_stdlib() -> None:
    assert not (REPO_ROOT / "platform" / "__init__.py").exists()
    proc = run_python("import platform; print(platform.system())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Linux"


def test_import_deepinfer_keeps_vendor_libraries_out() -> None:
    code = (
        "import sys, deepinfer, deepinfer.backends.ops, deepinfer.platform.registry\n"
        "import deepinfer.backends.reference\n"
        "bad = [m for m in ('torch_npu', 'triton') if m in sys.modules]\n"
        "print('loaded:', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_top_level_folders_resolve_inside_the_deepinfer_namespace() -> None:
    import deepinfer.backends
    import deepinfer.ops_ascend
    import deepinfer.ops_cuda
    import deepinfer.platform.registry

    for module, folder in [
        (deepinfer.backends, "backends"),
        (deepinfer.ops_cuda, "ops_cuda"),
        (deepinfer.ops_ascend, "ops_ascend"),
        (deepinfer.platform.registry, "platform"),
    ]:
        assert f"/{folder}/" in module.__file__
    assert "backends" not in sys.modules, "the top-level folder was imported as its own package"
