"""Conformance harness: the backend under test, shapes, tolerances, seeded inputs, comparison.

The oracle is always the reference backend in float32 on the CPU, fed the same (dtype-rounded) inputs
as the backend under test. Outputs are compared row by row: the error of a check is the largest
relative error ``||out_row - ref_row|| / ||ref_row||`` of any row (a row: one vector along the last
dimension), so one wrong row among thousands fails as surely as a wrong tensor. Every check runs with
uninitialised memory filled with NaN (``nan_filled_memory``), so an output element a kernel forgets to
write shows up as NaN on every platform.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer import envs
from deepinfer.backends.quant import WeightFormat
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


@contextmanager
def nan_filled_memory() -> Iterator[None]:
    """Within the block, memory torch allocates without initialising (``torch.empty``, ``new_empty``,
    ``empty_like`` and the ``at::empty`` of native kernels) comes filled with NaN (integers: their
    maximum), on the CPU as on CUDA: torch's ``fill_uninitialized_memory`` under deterministic
    algorithms, in warn-only mode so that no op refuses to run. Restores the previous settings."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    if not saved[0]:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def poison_device_memory(device: torch.device, nbytes: int = 64 << 20) -> None:
    """Fill freed device memory with NaN, for kernels whose outputs come from a device allocator that
    ``nan_filled_memory`` does not reach (a vendor's own caching allocator hands the same memory back).
    A no-op on the CPU, where ``nan_filled_memory`` covers every allocation."""
    if device.type == "cpu":
        return
    junk = torch.full((nbytes // 4,), float("nan"), device=device)
    del junk


# A reference row this much smaller than the tensor's typical row is compared on the typical row's
# scale (its relative error would be rounding noise over a near-zero norm).
ROW_NORM_FLOOR = 1e-3


def max_row_error(out: Tensor, ref: Tensor) -> float:
    """The largest ``||out_row - ref_row|| / ||ref_row||`` over the rows (vectors along the last
    dimension; a 0-d or 1-d tensor is one row), with ``||ref_row||`` floored at ``ROW_NORM_FLOOR``
    times the root-mean-square row norm. Infinite when ``out`` has a non-finite element."""
    out = out.detach().float().cpu().reshape(-1, out.shape[-1] if out.dim() else 1)
    ref = ref.detach().float().cpu().reshape(-1, ref.shape[-1] if ref.dim() else 1)
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    norms = ref.norm(dim=-1)
    typical = float(norms.square().mean().sqrt())
    floor = max(ROW_NORM_FLOOR * typical, 1e-30)
    return float(((out - ref).norm(dim=-1) / norms.clamp_min(floor)).max())


def assert_close(name: str, out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    """Fail with a clear message unless every row of ``out`` matches ``ref`` within the dtype's
    tolerance (``max_row_error``)."""
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    finite = torch.isfinite(out.detach().float().cpu())
    if not bool(finite.all()):
        raise AssertionError(f"{name}: {int((~finite).sum())} non-finite elements (unwritten or overflow)")
    if out.numel() == 0:
        return
    err = max_row_error(out, ref)
    tol = TOLERANCE[dtype]
    if not err < tol:
        rows = out.reshape(-1, out.shape[-1] if out.dim() else 1).shape[0]
        raise AssertionError(
            f"{name}: relative error {err:.3e} of its worst row (of {rows}) exceeds {tol:.0e} for {dtype}"
        )


# ----------------------------------------------------------------------------------------- quantised weights
# The weight formats every quantised op is checked in.
QUANT_FORMATS = (
    WeightFormat("fp8", (128, 128), "f32"),  # V3, R1
    WeightFormat("fp8", (128, 128), "ue8m0"),  # V3.1 to V4
    WeightFormat("fp8", (32, 32), "f32"),
    WeightFormat("fp8", (32, 32), "ue8m0"),  # V4.1
    WeightFormat("mxfp4", (1, 32), "ue8m0"),  # V4 routed experts
)
FP8_FORMATS = tuple(f for f in QUANT_FORMATS if f.kind == "fp8")


def format_id(fmt: WeightFormat) -> str:
    """A test id: ``fp8-128x128-f32``, ``mxfp4``."""
    return "mxfp4" if fmt.kind == "mxfp4" else f"fp8-{fmt.block[0]}x{fmt.block[1]}-{fmt.scale_fmt}"


# MoE shapes for the quantised expert ops. "odd": N and K not multiples of any block (fp8; at least
# two blocks of 128 along each, so that a transposed scale grid differs), or of 128 only (mxfp4 needs
# K, so hidden and intermediate, a multiple of 32); "rows4096": many rows, small dims. The DeepSeek-V3 case is ``v3_quant_moe``.
ODD_QUANT_MOE = MoEShape("odd", experts=6, top_k=2, n_group=1, topk_group=1, hidden=200, intermediate=136)
ODD_MXFP4_MOE = MoEShape("odd", experts=6, top_k=2, n_group=1, topk_group=1, hidden=160, intermediate=96)
ROWS4096_QUANT_MOE = MoEShape(
    "rows4096", experts=4, top_k=2, n_group=1, topk_group=1, hidden=64, intermediate=32
)


def quant_moe(name: str, fmt: WeightFormat) -> MoEShape:
    """The MoE shape ``name`` ("odd", "rows4096", "deepseek_v3") for weights in ``fmt``."""
    if name == "odd":
        return ODD_MXFP4_MOE if fmt.kind == "mxfp4" else ODD_QUANT_MOE
    if name == "rows4096":
        return ROWS4096_QUANT_MOE
    if name == "deepseek_v3":
        return v3_quant_moe()
    raise ValueError(f"quantised MoE shape {name!r}; choose 'odd', 'rows4096' or 'deepseek_v3'")


def v3_quant_moe() -> MoEShape:
    """DeepSeek-V3's top-8 routing for the quantised expert ops. With DEEPINFER_CONFORMANCE_FULL=1 the
    real 7168/2048 dims over 16 experts (the reference dequantises every expert to float32: all 256
    would take 30 GB a weight); otherwise ``v3_moe()``'s reduced dims over 32 experts (256 make the
    reference case take seconds on a small host, and the routing is random here anyway)."""
    shape = v3_moe()
    experts = 16 if envs.get("DEEPINFER_CONFORMANCE_FULL") else 32
    return MoEShape("deepseek_v3", experts, 8, 8, 4, shape.hidden, shape.intermediate)
