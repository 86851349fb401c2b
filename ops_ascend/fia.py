"""Conventions shared by the ``npu_fused_infer_attention_score`` (FIA v1) and ``_v2`` calls.

Checked against the op documentation in ``torch_npu/_op_plugin_docs.py`` (torch_npu 2.13.0):

- masks: sparse modes 2/3/4 take the fixed 2048 x 2048 "compressed" mask, bool/int8/uint8 with 1 =
  masked, upper-triangular ones above the diagonal; one device-resident copy serves every call;
- dtypes: query/key/value are float16 or bfloat16 (int8 only quantised); the TND prefill form is
  bfloat16 only. Float32 is not accepted by any FIA form, so float32 attention raises here instead of
  silently running at a lower precision;
- shapes: the kernels accept only a few head widths and head counts; inputs are zero-padded up to them
  (zero query/key columns add nothing to q.k, zero value columns and padded heads are sliced off).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

COMPRESSED_MASK_SIZE = 2048
"""Side of the compressed causal mask that sparse modes 2, 3 and 4 require."""

NO_LIMIT = 2147483647
"""FIA's default ``pre_tokens`` / ``next_tokens`` (no band limit)."""


@functools.cache
def compressed_causal_mask(device: torch.device) -> Tensor:
    """The 2048 x 2048 int8 mask of sparse modes 2/3/4: 1 above the diagonal (masked), 0 elsewhere."""
    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.int8, device=device)
    return torch.triu(ones, diagonal=1)


def require_half(op: str, x: Tensor) -> None:
    """Raise unless ``x`` is float16 or bfloat16, the only floating dtypes the FIA kernels take."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"{op} on Ascend runs npu_fused_infer_attention_score, which takes float16/bfloat16 only "
            f"(got {x.dtype}); run the model in bfloat16 or float16"
        )


def pad_last(x: Tensor, width: int) -> Tensor:
    """Zero-pad the last dimension of ``x`` to ``width`` (``x`` itself when it already has it)."""
    extra = width - x.shape[-1]
    if extra < 0:
        raise ValueError(f"cannot pad a last dimension of {x.shape[-1]} down to {width}")
    return x if extra == 0 else F.pad(x, (0, extra))


def pad_heads(x: Tensor, heads: int) -> Tensor:
    """Zero-pad dimension 1 (heads) of a [T, H, D] tensor to ``heads``."""
    extra = heads - x.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad {x.shape[1]} heads down to {heads}")
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
