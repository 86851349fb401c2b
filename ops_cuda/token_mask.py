"""Structured outputs: set the logits of tokens a grammar forbids to -inf, in place, from a packed bitmask."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2


@triton.jit
def _token_bitmask_kernel(logits_ptr, mask_ptr, V, stride_logits, stride_mask, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    word = tl.load(mask_ptr + row * stride_mask + cols // 32, mask=in_vocab, other=-1)
    forbidden = ((word >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=in_vocab & forbidden)


@OPS.implement
def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """logits: [B, V] float32 (unit stride along V), modified in place; bitmask: [B, ceil(V / 32)] int32,
    bit t % 32 of word t // 32 set when token t is allowed."""
    check_device(logits, bitmask)
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("apply_token_bitmask modifies logits in place: they need unit stride along V")
    bitmask = bitmask if bitmask.stride(-1) == 1 else bitmask.contiguous()
    block = min(4096, pow2(vocab))
    if rows:
        _token_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
            logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block, num_warps=4
        )
