"""RMSNorm and fused residual add + RMSNorm: one program per row, statistics in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    D,
    stride_x,
    stride_res,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[row] = rms_norm(x[row] (+ res[row])); with ADD_RESIDUAL the rounded sum goes to sum[row]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """x viewed as [rows, D] with unit stride along D (copied only if it cannot be viewed so)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    check_device(x, weight, *([] if residual is None else [residual]))
    rows = _rows(x)
    res_rows = None if residual is None else _rows(residual)
    d = rows.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(out)
    block = pow2(d)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            rows if res_rows is None else res_rows,
            weight,
            out,
            out if summed is None else summed,
            d,
            rows.stride(0),
            rows.stride(0) if res_rows is None else res_rows.stride(0),
            eps,
            ADD_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out, summed


@OPS.implement
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., D] fp32/bf16/fp16; weight: [D]. Returns a new tensor like x."""
    return _launch(x, None, weight, eps)[0]


@OPS.implement
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual: [T, D] same dtype; weight: [D]. Returns new ``(rms_norm(x + residual), x + residual)``."""
    normed, summed = _launch(x, residual, weight, eps)
    return normed, summed
