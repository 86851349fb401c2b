"""The CPU platform: always available; runs the fast CPU backend, or the reference one.

``DEEPINFER_CPU_BACKEND`` chooses the op backend: ``fast`` (``deepinfer.backends.cpu``, native
kernels compiled on this host), ``reference`` (``deepinfer.backends.reference``, the plain-PyTorch
oracle) or ``auto`` (default: fast when the kernels are built or can be built here, else the reference,
with a warning naming what is missing). ``fast`` on a host without a C++ toolchain is an error.
"""

from __future__ import annotations

import os
import platform as _stdlib_platform
import re
from collections.abc import Callable
from typing import Any

import torch

from deepinfer import envs
from deepinfer.logger import get_logger
from deepinfer.platform.interface import (
    Detection,
    EagerGraph,
    GraphCapture,
    Platform,
    PlatformUnavailableError,
)

logger = get_logger(__name__)

FAST_BACKEND = "deepinfer.backends.cpu.backend"
REFERENCE_BACKEND = "deepinfer.backends.reference"
_CHOICES = ("auto", "fast", "reference")


def cpu_op_backend() -> str:
    """The op backend module DEEPINFER_CPU_BACKEND selects on this host (see the module docstring)."""
    choice = envs.get("DEEPINFER_CPU_BACKEND")
    if choice not in _CHOICES:
        raise ValueError(f"DEEPINFER_CPU_BACKEND={choice!r}; choose one of: {', '.join(_CHOICES)}")
    if choice == "reference":
        return REFERENCE_BACKEND
    from deepinfer.backends.cpu.native import toolchain_problem

    problem = toolchain_problem()
    if problem is None:
        return FAST_BACKEND
    if choice == "fast":
        raise PlatformUnavailableError(
            f"DEEPINFER_CPU_BACKEND=fast, but the fast CPU kernels cannot be built: {problem}; "
            "install it or set DEEPINFER_CPU_BACKEND=reference"
        )
    logger.warning(
        "cpu: running the reference op backend (several times slower): the fast kernels cannot be "
        "built: %s. Set DEEPINFER_CPU_BACKEND=reference to silence this, or install it.",
        problem,
    )
    return REFERENCE_BACKEND


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    @property
    def op_backend(self) -> str:  # type: ignore[override]  (chosen per host and environment)
        return cpu_op_backend()

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

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        """The process's resident-set high-water mark during ``fn`` above its resident size before it
        (Linux: the mark is reset through ``/proc/self/clear_refs`` and read as ``VmHWM``). Heap that
        earlier work freed but glibc kept (``deepinfer.malloc_tuning`` keeps it all) is resident already
        and reused first, so only what ``fn`` took beyond it counts, which is what must stay free."""
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # 5: reset the peak resident set size to the current one
        except OSError as exc:
            raise RuntimeError(
                f"cannot measure a step's peak memory on this host ({exc}); set kv_cache_memory_gib or "
                "num_kv_blocks to size the KV cache yourself"
            ) from exc
        base = _resident_kib("VmRSS")
        fn()
        return max(0, _resident_kib("VmHWM") - base) * 1024

    def graph(self, pool: Any = None) -> GraphCapture:
        """The fast backend's ``CpuGraph`` (ops recorded once, replayed from C++ without Python); the
        eager wrapper under the reference backend, whose ops read values on the host."""
        del pool  # a CPU graph holds no memory of its own: its ops allocate as they replay
        if self.op_backend != FAST_BACKEND:
            return EagerGraph()
        from deepinfer.backends.cpu.graph import CpuGraph

        return CpuGraph()

    @property
    def graph_capture_default(self) -> bool:
        """On with the fast backend: a captured decode step skips the Python dispatch of every op,
        which is most of a small batch's step here (bench/cpu_graphs.py)."""
        return self.op_backend == FAST_BACKEND

    def graph_batch_sizes(self, max_batch: int) -> list[int]:
        """Every size: a CPU graph holds no memory of its own and captures in one eager run, while a
        padded row costs its full compute here."""
        return list(range(1, max_batch + 1))

    def lm_head_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """float32: D-major (a [D, V] contiguous copy, seen as its [V, D] transpose). MKL's float32
        ``[n, D] x [V, D]^T`` at n = 1-2 rows ran 2.5-3.5x faster reading it than the loaded V-major
        layout (bundled model, V = 8192, D = 192; n >= 8 about the same); bf16 is kept as loaded,
        which ran 10x faster than D-major."""
        if weight.dtype != torch.float32:
            return weight
        return weight.t().contiguous().t()


def _resident_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field in KiB (``VmRSS``: resident now; ``VmHWM``: peak)."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(match.group(1))
