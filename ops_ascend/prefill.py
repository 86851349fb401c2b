"""Expanded-form MLA prefill on ``npu_fused_infer_attention_score_v2`` in TND layout.

The interface hands q [Tq, H, Dn + R] and k [Tk, H, Dn + R] with the rope part already concatenated
(and k's rope already broadcast per head), and v [Tk, H, Dv]. That is exactly the doc's TND form without
``query_rope`` / ``key_rope``: "Q_D、K_D等于192，V_D等于128/192" (or all three 128) — DeepSeek-V3's
128 + 64 / 128 with no copy at all. The split form (``query_rope`` / ``key_rope``, D = 128 + 64) would
need four strided-slice copies to feed a kernel that rejects non-contiguous inputs, so it is not used.
Narrower heads (test models) are zero-padded to the nearest accepted widths.

Checked against the v2 doc (TND, d != 512):
- ``actual_seq_qlen`` / ``actual_seq_kvlen`` are host lists of CUMULATIVE lengths (the prefix sums
  without the leading 0); their count is the batch size and may not exceed 4096; T <= 1M;
- bfloat16 only: float16 inputs are computed in bfloat16 and cast back, float32 raises;
- causal masking is ``sparse_mode=3`` (right-down aligned: query i of a request with len_q queries and
  len_k keys sits at key position len_k - len_q + i) with the 2048 x 2048 compressed mask; a sliding
  window is ``sparse_mode=4`` (band, origin at the right-down corner) with ``pre_tokens = W - 1`` and
  ``next_tokens = 0``, i.e. keys j with p - W < j <= p;
- ``softmax_scale`` defaults to 1.0 and is always passed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.fia import NO_LIMIT, compressed_causal_mask, pad_last, require_half
from deepinfer.ops_ascend.host import host_list
from deepinfer.ops_ascend.npu import torch_npu

TND_WIDTHS = ((128, 128), (192, 128), (192, 192))
"""(q/k width, v width) pairs the TND form accepts without rope inputs."""
MAX_TOKENS = 1 << 20
MAX_BATCH = 4096


def _kernel_widths(qk_width: int, v_width: int) -> tuple[int, int]:
    for qk, v in TND_WIDTHS:
        if qk_width <= qk and v_width <= v:
            return qk, v
    raise ValueError(
        f"mla_prefill: q/k width {qk_width} with v width {v_width} fits none of the TND head widths "
        f"npu_fused_infer_attention_score_v2 accepts {TND_WIDTHS}"
    )


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
    require_half("mla_prefill", q)
    num_q, heads, v_width = q.shape[0], q.shape[1], v.shape[-1]
    cum_q, cum_k = host_list(cu_seqlens_q)[1:], host_list(cu_seqlens_k)[1:]
    if len(cum_q) > MAX_BATCH:
        raise ValueError(f"mla_prefill: {len(cum_q)} requests exceed the TND limit of {MAX_BATCH} per call")
    if max(num_q, k.shape[0]) > MAX_TOKENS:
        raise ValueError(f"mla_prefill: {max(num_q, k.shape[0])} tokens exceed the TND limit of {MAX_TOKENS}")
    if num_q == 0:
        return q.new_empty(0, heads, v_width)
    qk_width, padded_v = _kernel_widths(q.shape[-1], v_width)

    def fit(x: Tensor, width: int) -> Tensor:
        return pad_last(x.to(torch.bfloat16), width).contiguous()

    pre_tokens, next_tokens = (NO_LIMIT, NO_LIMIT) if sliding_window is None else (sliding_window - 1, 0)
    out, _ = torch_npu().npu_fused_infer_attention_score_v2(
        fit(q, qk_width),
        fit(k, qk_width),
        fit(v, padded_v),
        atten_mask=compressed_causal_mask(q.device),
        actual_seq_qlen=cum_q,
        actual_seq_kvlen=cum_k,
        num_query_heads=heads,
        num_key_value_heads=heads,
        softmax_scale=scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        input_layout="TND",
        sparse_mode=3 if sliding_window is None else 4,
    )
    return out[..., :v_width].to(q.dtype)
