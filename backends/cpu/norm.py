"""Fused RMSNorm, residual add + RMSNorm, rotary embedding and SwiGLU: one native pass each."""

from __future__ import annotations

from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()


@OPS.implement
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _native.rms_norm(x, weight, eps)


@OPS.implement
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _native.add_rms_norm(x, residual, weight, eps)


@OPS.implement
def rope(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    return _native.rope(q, k, positions, cos_sin_cache, interleaved)


@OPS.implement
def silu_and_mul(x: Tensor) -> Tensor:
    return _native.silu_and_mul(x)


OPS.declare_invariant(
    ["silu_and_mul"],
    "native kernel: silu(gate) * up in float32, every element through the same 16-lane vector code (the "
    "last lanes of a row masked: no scalar tail, no alignment peeling, no size-dependent thread split)",
)
