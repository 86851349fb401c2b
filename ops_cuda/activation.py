"""The SwiGLU activation ``silu(gate) * up`` over rows holding ``[gate | up]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32 (a helper shared with the grouped-GEMM epilogue)."""
    gate = gate.to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * inter + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


@OPS.implement
def silu_and_mul(x: Tensor) -> Tensor:
    """x: [..., 2I] holding ``[gate | up]``; returns a new [..., I] in x's dtype."""
    check_device(x)
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    block = min(pow2(inter), 1024)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, inter, rows.stride(0), BLOCK=block, num_warps=4
        )
    return out
