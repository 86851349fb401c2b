"""Launch-side helpers shared by the Triton kernels: where they may run and what the device allows.

Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, how
the conformance suite exercises them on a host without a GPU). Launch configurations are derived from
the device's limits (SM count, shared memory per block) rather than from its name, so one source serves
SM80, SM90 and SM100, and parts with less shared memory (SM86/SM89/SM120) get fewer pipeline stages.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """What a launch configuration must respect on one device."""

    sm_count: int
    shared_memory: int  # bytes one program may use (the opt-in maximum)
    capability: tuple[int, int]


LOG2E = 1.4426950408889634  # softmax kernels fold it into the scale and use exp2

# The interpreter runs program instances one after another on the CPU: a small nominal SM count keeps
# grids small while the split-KV paths still split.
INTERPRETER_LIMITS = DeviceLimits(sm_count=4, shared_memory=227 * 1024, capability=(9, 0))


def interpreted() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor) -> torch.device:
    """The common device of ``tensors``; raises unless it is CUDA, or CPU under the interpreter."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"deepinfer.ops_cuda: tensors on {device} and {t.device}; expected one device")
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return device
    raise RuntimeError(
        f"deepinfer.ops_cuda kernels need CUDA tensors (got {device}); CPU tensors run only under "
        "Triton's interpreter (TRITON_INTERPRET=1)"
    )


def device_limits(device: torch.device) -> DeviceLimits:
    """SM count, shared memory per program and compute capability of ``device``."""
    if device.type != "cuda":
        return INTERPRETER_LIMITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_limits(index)


@functools.cache
def _cuda_limits(index: int) -> DeviceLimits:
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    return DeviceLimits(
        sm_count=props["multiprocessor_count"],
        shared_memory=props["max_shared_mem"],
        capability=torch.cuda.get_device_capability(index),
    )


def pipeline_stages(limits: DeviceLimits, bytes_per_stage: int, reserved: int = 0, most: int = 4) -> int:
    """How many software-pipeline stages of ``bytes_per_stage`` shared memory fit beside ``reserved``
    bytes (1 to ``most``)."""
    return max(1, min(most, (limits.shared_memory - reserved) // max(1, bytes_per_stage)))


def pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return triton.next_power_of_2(max(1, n))


def block_pow2(n: int, least: int = 16) -> int:
    """A tile edge covering ``n`` for ``tl.dot`` operands (a power of two, at least ``least``)."""
    return max(least, pow2(n))
