"""Rotary position embedding on torch_npu with ``npu_rotary_mul``.

``npu_rotary_mul(input, r1, r2, rotary_mode)`` computes ``r1 * x + r2 * rotate(x)`` with
``rotate(x) = cat(-x2, x1)`` ('half') or the pairwise ``(-x[2i+1], x[2i])`` ('interleave'), so with r1 / r2
holding each pair's cos / sin in the pair's own dims it writes the rotated pair back to the same two dims:
the interface's layout in both modes. The output therefore stays interleaved for DeepSeek's layout, and
the KV cache, the decode query and every cache reader see one rope layout.

``npu_interleave_rope`` (the op vllm-ascend uses) is not used: it requires D = 64, takes no float32, and
returns the rotated vector de-interleaved, which would break the interface's layout.

Layout: q [T, H, R] is viewed as BSND [1, T, H, R] and k [T, R] as [1, T, 1, R]; r1 / r2 are [1, T, 1, R]
(the 1S1D broadcast the interleave mode requires for BSND). Limits (doc): D even and < 896; B, N < 1000
('half') and B * N < 1000 ('interleave'), so with B = 1 fewer than 1000 heads; r1 / r2 values in [-1, 1]
(cos / sin; a table with an attention factor above 1 folded in is outside that documented range).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.npu import torch_npu

MAX_ROPE_DIM = 896
MAX_HEADS = 1000


def _cos_sin(
    cos_sin_cache: Tensor, positions: Tensor, interleaved: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """r1 / r2 for ``npu_rotary_mul``: each frequency's cos / sin repeated onto both dims of its pair."""
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.to(dtype)[None, :, None, :], sin.to(dtype)[None, :, None, :]


@OPS.implement
def rope(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    num_tokens, heads, width = q.shape
    if width % 2 or width >= MAX_ROPE_DIM:
        raise ValueError(f"npu_rotary_mul needs an even rope dimension below {MAX_ROPE_DIM}, got {width}")
    if heads >= MAX_HEADS:
        raise ValueError(f"npu_rotary_mul takes fewer than {MAX_HEADS} heads, got {heads}")
    mode = "interleave" if interleaved else "half"
    npu = torch_npu()
    r1, r2 = _cos_sin(cos_sin_cache, positions, interleaved, q.dtype)
    q_rot = npu.npu_rotary_mul(q.contiguous()[None], r1, r2, rotary_mode=mode)
    if k.dtype != q.dtype:
        r1, r2 = r1.to(k.dtype), r2.to(k.dtype)
    k_rot = npu.npu_rotary_mul(k.contiguous().view(1, num_tokens, 1, width), r1, r2, rotary_mode=mode)
    return q_rot[0], k_rot.view(num_tokens, width)
