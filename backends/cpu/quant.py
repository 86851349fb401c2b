"""Quantised weights kept as stored, on the CPU: native kernels (``csrc/quant_gemm.cpp``) for
``fp8_linear`` (W8A16), ``fp8_linear_w8a8``, ``grouped_gemm_quant`` and ``fused_moe_quant``.

The FP8 (e4m3, block-scaled) and MXFP4 (e2m1, e8m0 per 32) bytes stay in memory as they are; each
vector of them is decoded in registers (e4m3 by bit operations through an IEEE half, exact including
subnormals; e2m1 by a 16-entry permute) and every product accumulates in float32. Up to
``SKINNY_ROWS`` activation rows (``MOE_SKINNY_ROWS`` rows of one expert) the weight is streamed once
per four rows and each K block's partial sum is multiplied by that block's scale inside the K loop: a
decode token reads a quarter of the fp32 bytes. More rows dequantise one panel of weight rows at a
time (up to 4 MB of float32) into a buffer and multiply all rows by it with oneDNN (MKL where torch
lacks it).

Instruction set: ``DEEPINFER_CPU_ISA`` (``auto`` picks the best the CPU reports by cpuid: AVX-512,
else AVX2 + FMA + F16C, else portable C++); every set is compiled into the library whatever the build
host, so forcing one tests its path (see the C++ file for what forcing ``avx2`` on an AVX-512 host
does and does not prove). Activations may be float32, bfloat16 or float16; bfloat16 and float16 are
widened to float32 once per call (no AVX512-BF16 dot-product or AMX path yet).

Batch invariance: the few-row kernel gives a row the same bits whatever the other rows, but the
panel path (MKL, many rows) rounds differently, so whether a row's result depends on the batch's row
count decides: the default is variant, and deterministic mode runs every row count through the
few-row kernel (``implement_invariant``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer import envs
from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load
from deepinfer.backends.quant import WeightFormat, dequantize

_native = load()

# Measured on the AMD EPYC (AVX-512, one thread, fp8 128x128 blocks), per call, the few-row kernel
# against dequantised panels + oneDNN: 512x192 weights 48 vs 47 us at 16 rows, 70 vs 56 at 24;
# 128x192 (an expert's gate_up) 14 vs 23 at 16 rows, 27 vs 28 at 32; 2048x2048 1.4 vs 1.9 ms at 16 rows,
# 2.2 vs 2.2 at 24, 2.9 vs 2.5 at 32.
SKINNY_ROWS = 16  # activation rows up to which fp8_linear uses the few-row kernel
MOE_SKINNY_ROWS = 24  # rows of one expert up to which the MoE ops use it (experts are narrow)
INVARIANT_ROWS = 1 << 62  # deterministic mode: every row count through the few-row kernel

ISAS = ("generic", "avx2", "avx512")  # DEEPINFER_CPU_ISA names, by the kernels' codes
_KIND = {"fp8": 0, "mxfp4": 1}


def supported_isas() -> list[str]:
    """The instruction sets whose kernels this CPU can run (cpuid), ascending."""
    return [ISAS[code] for code in _native.quant_supported_isas()]


def isa_code() -> int:
    """``DEEPINFER_CPU_ISA`` as the kernels' code (-1: auto); read at each call."""
    name = envs.get("DEEPINFER_CPU_ISA")
    if name == "auto":
        return -1
    if name not in ISAS:
        raise ValueError(f"DEEPINFER_CPU_ISA must be auto or one of {', '.join(ISAS)}, got {name!r}")
    return ISAS.index(name)


def _linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None, rows: int
):
    # The native op checks the block, the pair and x (ValueError naming what is wrong).
    return _native.quant_linear(x, weight, weight_scale, 0, block[0], block[1], bias, isa_code(), rows)


@OPS.implement
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    return _linear(x, weight, weight_scale, block, bias, SKINNY_ROWS)


def _w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, rows: int) -> Tensor:
    # No FP8 multiplier on a CPU: the activations are dequantised (a few rows x K) and the W8A16 kernel
    # runs; the weight stays FP8.
    x = dequantize(x_values, x_scale, WeightFormat("fp8", (1, block[1])))
    return _linear(x, weight, weight_scale, block, bias, rows).to(out_dtype)


@OPS.implement
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    return _w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, SKINNY_ROWS)


@OPS.implement
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    return _native.quant_grouped_gemm(
        x, weight, weight_scale, _KIND[fmt.kind], *fmt.block, group_sizes, isa_code(), MOE_SKINNY_ROWS
    )


@OPS.implement
def fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    return _native.quant_fused_moe(
        hidden, w13, w13_scale, w2, w2_scale, _KIND[fmt.kind], *fmt.block, topk_weights, topk_ids, isa_code(),
        MOE_SKINNY_ROWS,
    )  # fmt: skip


# ------------------------------------------------------------------------------ deterministic mode
_ROW_KERNEL = (
    "native few-row kernel for every row count: a row's products are summed per K block in an order fixed "
    "by K and the block, its partial sums scaled and added in block order, whatever the other rows, their "
    "number or the thread"
)


@OPS.implement_invariant(_ROW_KERNEL)
def fp8_linear(  # noqa: F811  (the deterministic-mode formulation of the op above)
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    return _linear(x, weight, weight_scale, block, bias, INVARIANT_ROWS)


@OPS.implement_invariant(_ROW_KERNEL + "; the activations dequantised per row")
def fp8_linear_w8a8(  # noqa: F811
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    return _w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, INVARIANT_ROWS)


@OPS.implement_invariant(_ROW_KERNEL + ", per expert")
def grouped_gemm_quant(  # noqa: F811
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    return _native.quant_grouped_gemm(
        x, weight, weight_scale, _KIND[fmt.kind], *fmt.block, group_sizes, isa_code(), INVARIANT_ROWS
    )


@OPS.implement_invariant(
    _ROW_KERNEL + ", per expert; the SwiGLU elementwise; a token's k expert outputs added in slot order"
)
def fused_moe_quant(  # noqa: F811
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    return _native.quant_fused_moe(
        hidden, w13, w13_scale, w2, w2_scale, _KIND[fmt.kind], *fmt.block, topk_weights, topk_ids, isa_code(),
        INVARIANT_ROWS,
    )  # fmt: skip
