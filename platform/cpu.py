"""The CPU platform: always available; runs the reference backend (plain PyTorch)."""

from __future__ import annotations

import os
import platform as _stdlib_platform

from deepinfer.platform.interface import Detection, Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    op_backend = "deepinfer.backends.reference"

    @classmethod
    def detect(cls) -> Detection:
        cores = os.cpu_count() or 1
        model = _stdlib_platform.processor() or _stdlib_platform.machine()
        return Detection(
            True, f"CPU host with {cores} cores", device_name=f"{model}, {cores} cores", chip="cpu"
        )

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
