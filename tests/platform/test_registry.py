"""Platform selection: explicit choices, auto, unknown names, and the messages users see."""

from __future__ import annotations

import logging

import pytest

from deepinfer.platform.cpu import CpuPlatform
from deepinfer.platform.interface import PlatformUnavailableError
from deepinfer.platform.registry import current_platform, registered_platforms, resolve_platform


def test_cpu_and_auto_select_cpu_here(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(resolve_platform("cpu"), CpuPlatform)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "auto")
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        platform = current_platform()
    assert isinstance(platform, CpuPlatform)
    assert platform.dist_backend == "gloo" and platform.device_type == "cpu"
    message = caplog.text
    assert "auto -> cpu" in message
    assert "ascend: CANN not found" in message and "nvidia: no CUDA GPU" in message


def test_ascend_names_cann(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(PlatformUnavailableError) as err:
        current_platform()
    assert (
        "CANN" in str(err.value) and "ASCEND_HOME_PATH" in str(err.value) and "set_env.sh" in str(err.value)
    )


def test_ascend_with_cann_env_but_no_torch_npu_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", "/nonexistent/cann")
    with pytest.raises(PlatformUnavailableError, match="torch_npu is not installed"):
        resolve_platform("ascend")


def test_nvidia_names_cuda() -> None:
    with pytest.raises(PlatformUnavailableError) as err:
        resolve_platform("nvidia")
    assert "no CUDA GPU" in str(err.value)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError) as err:
        resolve_platform("bogus")
    assert "'bogus'" in str(err.value)
    assert "auto, ascend, cpu, nvidia" in str(err.value)


def test_builtins_are_registered_without_importing_them() -> None:
    table = registered_platforms()
    assert {"cpu", "nvidia", "ascend"} <= set(table)
    assert all(":" in qualname for qualname in table.values())


def test_cpu_platform_facts() -> None:
    platform = resolve_platform("cpu")
    free, total = platform.mem_get_info()
    assert 0 < free <= total
    assert platform.node_role.value == "both"
    assert platform.op_backend == "deepinfer.backends.cpu.backend"  # DEEPINFER_CPU_BACKEND=auto, g++ here
