"""Reference rotary embedding (interleaved DeepSeek layout or rotate-half layout)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.backends.reference import OPS


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return out.to(x.dtype)


@OPS.implement
def rope(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cos_sin.chunk(2, dim=-1)
    q_rot = _rotate(q, cos[:, None, :], sin[:, None, :], interleaved)
    k_rot = _rotate(k, cos, sin, interleaved)
    return q_rot, k_rot
