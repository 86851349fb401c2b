"""Variable-length causal flash attention in expanded MLA form (prefill and chunked prefill).

Each request's queries are the last len_q of its len_k keys, so the causal mask is bottom-right
aligned; an optional sliding window hides keys more than W - 1 positions back. A program handles one
request, one head and BLOCK_M queries, and walks only the key tiles its queries can see. The q/k head
dim (Dn + R, 192 in DeepSeek-V3) need not be a power of two: it is split into a power-of-two head part
and a padded tail (128 + 64), each its own ``tl.dot``. The value width may differ from it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.online_softmax import online_softmax_step
from deepinfer.ops_cuda.runtime import LOG2E, block_pow2, check_device, device_limits, pipeline_stages


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_q_ptr,
    cu_k_ptr,
    D,
    DV,
    window,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    len_q = tl.load(cu_q_ptr + b + 1) - q_start
    k_start = tl.load(cu_k_ptr + b)
    len_k = tl.load(cu_k_ptr + b + 1) - k_start
    if m_block * BLOCK_M < len_q:
        i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = i < len_q
        q_pos = len_k - len_q + i
        first_pos = len_k - len_q + m_block * BLOCK_M
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0)
        hi = tl.minimum(first_pos + BLOCK_M, len_k)

        d = tl.arange(0, BLOCK_D)
        dt = BLOCK_D + tl.arange(0, BLOCK_TAIL)
        dv = tl.arange(0, BLOCK_DV)
        q_rows = q_ptr + (q_start + i).to(tl.int64)[:, None] * stride_q_t + head * stride_q_h
        q_head = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
        q_tail = tl.load(q_rows + dt[None, :], mask=row_ok[:, None] & (dt < D)[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            key_ok = j < hi
            token = (k_start + j).to(tl.int64)
            k_rows = k_ptr + token[:, None] * stride_k_t + head * stride_k_h
            k_head = tl.load(k_rows + d[None, :], mask=key_ok[:, None], other=0.0)
            k_tail = tl.load(k_rows + dt[None, :], mask=key_ok[:, None] & (dt < D)[None, :], other=0.0)
            v = tl.load(
                v_ptr + token[:, None] * stride_v_t + head * stride_v_h + dv[None, :],
                mask=key_ok[:, None] & (dv < DV)[None, :],
                other=0.0,
            )
            s = tl.dot(q_head, tl.trans(k_head), input_precision="ieee")
            s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision="ieee") * scale_log2
            visible = key_ok[None, :] & (j[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible &= j[None, :] > q_pos[:, None] - window
            m_i, l_i, acc = online_softmax_step(s, visible, m_i, l_i, acc, v)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        dst = out_ptr + (q_start + i).to(tl.int64)[:, None] * stride_o_t + head * stride_o_h + dv[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])


def head_split(width: int) -> tuple[int, int]:
    """(power-of-two head part, padded tail) covering ``width``: 192 -> (128, 64), 32 -> (32, 16).

    A tail is always loaded (masked off entirely when the head part covers the width), since
    ``tl.dot`` operands need at least 16 columns."""
    head = 1 << (width.bit_length() - 1)
    return head, block_pow2(width - head)


@OPS.implement
def mla_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """q: [Tq, H, Dn + R]; k: [Tk, H, Dn + R]; v: [Tk, H, Dv] (unit stride along the last dim);
    cu_seqlens_q / cu_seqlens_k: [B+1] int32. Returns a new [Tq, H, Dv] in q's dtype."""
    device = check_device(q, k, v, cu_seqlens_q, cu_seqlens_k)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tokens, heads, width = q.shape
    value_width = v.shape[-1]
    out = torch.empty((tokens, heads, value_width), dtype=q.dtype, device=q.device)
    num_reqs = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or num_reqs == 0:
        return out
    block_d, block_tail = head_split(width)
    # 128 x 64 tiles for 16-bit heads up to DeepSeek-V3's 192 + 128; halved where the q tile and the
    # accumulator would not fit the registers (float32, wider heads).
    wide = q.element_size() > 2 or width + value_width > 384
    block_m, block_n = (64, 32) if wide else (128, 64)
    stage_bytes = block_n * (block_d + block_tail + block_pow2(value_width)) * q.element_size()
    stages = pipeline_stages(
        device_limits(device), stage_bytes, reserved=block_m * (block_d + block_tail) * q.element_size()
    )
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, num_reqs)
    _prefill_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        width,
        value_width,
        sliding_window or 0,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_WINDOW=sliding_window is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_TAIL=block_tail,
        BLOCK_DV=block_pow2(value_width),
        num_warps=8 if block_m == 128 else 4,
        num_stages=min(stages, 3),
    )
    return out
