"""Conformance harness: the backend under test, shapes, tolerances, seeded inputs, comparison.

The oracle is always the reference backend in float32 on the CPU, fed the same (dtype-rounded) inputs
as the backend under test. Errors are relative Frobenius norms ``||out - ref|| / ||ref||``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer import envs
from deepinfer.backends.registry import REFERENCE_BACKEND, OpTable, load_backend

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Target:
    """The backend under test and where its tensors live."""

    ops: OpTable
    device: torch.device
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True, slots=True)
class MLAShape:
    name: str
    heads: int
    kv_lora_rank: int
    rope: int
    nope: int
    v: int


@dataclass(frozen=True, slots=True)
class MoEShape:
    name: str
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    hidden: int
    intermediate: int


SMALL_MLA = MLAShape("small", heads=4, kv_lora_rank=32, rope=16, nope=16, v=24)
V3_MLA = MLAShape("deepseek_v3", heads=128, kv_lora_rank=512, rope=64, nope=128, v=128)
SMALL_MOE = MoEShape("small", experts=16, top_k=4, n_group=4, topk_group=2, hidden=64, intermediate=32)


def v3_moe() -> MoEShape:
    """DeepSeek-V3 routing (256 experts, top-8, 8 groups, top-4 groups). Hidden/intermediate are the
    real 7168/2048 with DEEPINFER_CONFORMANCE_FULL=1 (device runners), reduced otherwise so the case
    fits a small CPU host."""
    full = envs.get("DEEPINFER_CONFORMANCE_FULL")
    return MoEShape(
        "deepseek_v3",
        experts=256,
        top_k=8,
        n_group=8,
        topk_group=4,
        hidden=7168 if full else 256,
        intermediate=2048 if full else 64,
    )


def reference_ops() -> OpTable:
    return load_backend(REFERENCE_BACKEND)


def target_from_env() -> Target:
    """The backend under test: the op backend of the platform named by DEEPINFER_ACCELERATOR, on its
    device; or, with DEEPINFER_CONFORMANCE_BACKEND, that backend module on
    DEEPINFER_CONFORMANCE_DEVICE (default cpu). DEEPINFER_CONFORMANCE_DTYPES picks the dtypes."""
    names = [n.strip() for n in envs.get("DEEPINFER_CONFORMANCE_DTYPES").split(",")]
    unknown = [n for n in names if n not in DTYPE_NAMES]
    if unknown:
        raise ValueError(
            f"DEEPINFER_CONFORMANCE_DTYPES: unknown {unknown}; choose from {sorted(DTYPE_NAMES)}"
        )
    dtypes = tuple(DTYPE_NAMES[n] for n in names)
    module = envs.get("DEEPINFER_CONFORMANCE_BACKEND")
    if module:
        device = torch.device(envs.get("DEEPINFER_CONFORMANCE_DEVICE") or "cpu")
        return Target(ops=load_backend(module), device=device, dtypes=dtypes)
    from deepinfer.platform.registry import resolve_platform

    platform = resolve_platform()
    return Target(ops=load_backend(platform.op_backend), device=platform.device(), dtypes=dtypes)


def generator(case_id: str) -> torch.Generator:
    """A CPU generator seeded from the case id: fresh inputs per case, stable across runs."""
    return torch.Generator().manual_seed(zlib.crc32(case_id.encode()))


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    """Float32 normal values on the CPU (never zeros), for rounding to the case dtype."""
    return torch.randn(*shape, generator=gen) * scale


def poison_device_memory(device: torch.device, nbytes: int = 64 << 20) -> None:
    """Fill freed device memory with NaN so that an output element a kernel forgets to write shows
    up as NaN (caching allocators hand the same memory back). A no-op on the CPU, where large
    allocations come back zeroed from the OS and the reference backend is the one under test."""
    if device.type == "cpu":
        return
    junk = torch.full((nbytes // 4,), float("nan"), device=device)
    del junk


def rel_error(out: Tensor, ref: Tensor) -> float:
    out = out.detach().float().cpu()
    ref = ref.detach().float().cpu()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(name: str, out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    """Fail with a clear message unless ``out`` matches ``ref`` within the dtype's tolerance."""
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    finite = torch.isfinite(out.detach().float().cpu())
    if not bool(finite.all()):
        raise AssertionError(f"{name}: {int((~finite).sum())} non-finite elements (unwritten or overflow)")
    err = rel_error(out, ref)
    tol = TOLERANCE[dtype]
    if not err < tol:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds {tol:.0e} for {dtype}")
