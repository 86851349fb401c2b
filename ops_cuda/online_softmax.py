"""The flash-attention inner step both MLA kernels share (a Triton device function, inlined)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, visible, m_i, l_i, acc, v):
    """Fold one key tile into a running softmax-weighted sum.

    s: [M, N] scores already scaled by log2(e) * scale; visible: [M, N] bool; m_i, l_i: [M] running
    maximum and normaliser (base 2); acc: [M, D] float32 running output; v: [N, D] the tile's values.
    Returns the updated (m_i, l_i, acc). Rows that have seen no visible key keep m_i = -inf, l_i = 0.
    """
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay at zero
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc
