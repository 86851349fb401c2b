"""The NVIDIA platform: CUDA GPUs of compute capability 8.x (Ampere), 9.0 (Hopper) and 10.x (Blackwell).

Ops come from ``deepinfer.ops_cuda`` (Triton, one source for SM80/SM90/SM100); collectives use NCCL;
decode steps are captured as CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.platform.interface import Detection, DeviceGraph, GraphCapture, Platform, device_peak_memory_of


def chip_for_capability(major: int, minor: int) -> str | None:
    """Chip-facts key for a CUDA compute capability, or None when the GPU is too old (< 8.0)."""
    if major >= 10:
        return "sm100"
    if major == 9:
        return "sm90"
    if major == 8:
        return "sm80"
    return None


class NvidiaPlatform(Platform):
    name = "nvidia"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    op_backend = "deepinfer.ops_cuda"

    @classmethod
    def detect(cls) -> Detection:
        if torch.version.cuda is None:
            return Detection(
                False,
                f"no CUDA GPU: this torch ({torch.__version__}) is a CPU-only build without CUDA support",
            )
        if not torch.cuda.is_available():
            return Detection(
                False,
                f"no CUDA GPU found: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}); check the driver and CUDA_VISIBLE_DEVICES",
            )
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        chip = chip_for_capability(major, minor)
        if chip is None:
            return Detection(False, f"{name} has compute capability {major}.{minor}; deepinfer needs >= 8.0")
        return Detection(True, f"{name} (sm{major}{minor})", device_name=name, chip=chip)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        return torch.cuda.mem_get_info(index)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        return device_peak_memory_of(torch.cuda, fn)

    def graph(self, pool: Any = None) -> GraphCapture:
        return DeviceGraph(torch.cuda, torch.cuda.CUDAGraph, pool)

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()
