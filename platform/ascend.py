"""The Ascend platform: Huawei NPUs through torch_npu and CANN.

Detection never imports ``torch_npu`` unless CANN's environment is present: on a host without CANN,
importing torch_npu breaks ``import torch`` itself. The chip is read from the device name (950PR ->
prefill role, 950DT -> decode role, A2/A3 -> both).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from deepinfer.platform.interface import Detection, DeviceGraph, GraphCapture, Platform, device_peak_memory_of

CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")

_CHIP_MARKERS = (
    ("950PR", "ascend950pr"),
    ("950DT", "ascend950dt"),
    ("910_93", "ascend910c"),
    ("910C", "ascend910c"),
    ("910B", "ascend910b"),
)


def chip_from_device_name(device_name: str) -> str | None:
    """Chip-facts key for an NPU device name such as ``Ascend950PR`` or ``Ascend910B3``."""
    upper = device_name.upper().replace(" ", "")
    for marker, chip in _CHIP_MARKERS:
        if marker in upper:
            return chip
    return None


def _torch_npu() -> Any:
    return importlib.import_module("torch_npu")


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    op_backend = "deepinfer.ops_ascend"

    @classmethod
    def detect(cls) -> Detection:
        if not any(os.environ.get(v) for v in CANN_ENV_VARS):
            return Detection(
                False,
                "CANN not found: neither ASCEND_HOME_PATH nor ASCEND_TOOLKIT_HOME is set "
                "(source CANN's set_env.sh, e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)",
            )
        if importlib.util.find_spec("torch_npu") is None:
            return Detection(
                False,
                "torch_npu is not installed (run `DEEPINFER_ACCELERATOR=ascend ./build.sh` on this CANN host)",
            )
        try:
            torch_npu = _torch_npu()
        except Exception as exc:  # a broken CANN/torch_npu pairing surfaces here; report it verbatim
            return Detection(False, f"torch_npu failed to import: {exc}")
        import torch

        if not torch.npu.is_available():
            return Detection(
                False, "torch_npu imported but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES)"
            )
        name = torch.npu.get_device_name(0)
        chip = chip_from_device_name(name)
        if chip is None:
            known = ", ".join(marker for marker, _ in _CHIP_MARKERS)
            return Detection(False, f"unrecognised Ascend device {name!r}; known chips contain: {known}")
        del torch_npu
        return Detection(True, f"{name} via torch_npu", device_name=name, chip=chip)

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        import torch

        return torch.npu.mem_get_info(index)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        import torch

        return device_peak_memory_of(torch.npu, fn)

    def graph(self, pool: Any = None) -> GraphCapture:
        import torch

        return DeviceGraph(torch.npu, torch.npu.NPUGraph, pool)

    def graph_pool(self) -> Any:
        import torch

        return torch.npu.graph_pool_handle()
