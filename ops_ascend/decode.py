"""Absorbed MLA decode over the paged latent cache on the FIA MLA kernel.

Without a sliding window (DeepSeek-V3): ``npu_fused_infer_attention_score_v2`` in its MLA form, checked
against the v2 doc ("当query的d等于512时"):
- query = q_nope [T, N, 512] and ``query_rope`` = q_pe [T, N, 64] in TND layout; N a power of two up to
  128 (other head counts are zero-padded to the next power of two, as vllm-ascend does), at most 16
  query tokens per request;
- key = value = the latent cache viewed [num_blocks, 1, 128, 512] (BnNBsD) and ``key_rope`` = the rope
  cache [num_blocks, 1, 128, 64], one KV head; paged attention with ``block_table`` [B, M] int32 and
  ``block_size`` 128 is mandatory in this form;
- ``actual_seq_qlen`` = CUMULATIVE query counts (TND), ``actual_seq_kvlen`` = PER-REQUEST total lengths
  (paged KV), both host lists;
- all requests with one query token: ``sparse_mode=0`` and no mask; otherwise ``sparse_mode=3`` with the
  compressed mask (right-down causal: query i of n sits at position seq_len - n + i);
- ``softmax_scale`` (default 1.0) is always passed.

With a sliding window: the v2 MLA form has no band mode; FIA v1's MLA form does, for ``sparse_mode=4`` in
BSND layout with N = 128 (per the v1 doc: query S per request <= key S, key S <= 131088, block size 64 or
128, key/value as [num_blocks, block_size, 512]). Queries are placed in a padded [B, max_query_len, 128,
512] batch; ``actual_seq_lengths`` holds per-request query counts (not cumulative: BSND) and
``pre_tokens = W - 1``, ``next_tokens = 0`` keep keys p - W < j <= p.

Widths other than the kernel's 512 + 64 (test models) are zero-padded: the queries directly, and the
cache through a padded copy of the blocks the batch's block table names (correct, but a copy per call;
DeepSeek models never take this path).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.fia import (
    compressed_causal_mask,
    next_power_of_two,
    pad_heads,
    pad_last,
    require_half,
)
from deepinfer.ops_ascend.graph import fused_infer_attention
from deepinfer.ops_ascend.host import host_list
from deepinfer.ops_ascend.npu import torch_npu

LATENT = 512
ROPE = 64
MAX_HEADS = 128
MAX_QUERIES_PER_REQUEST = 16
MAX_WINDOWED_KEYS = 131088


def tnd_lengths(seq_lens: Sequence[int], query_start_loc: Sequence[int]) -> dict[str, list[int]]:
    """Host lengths of the v2 TND call: cumulative query counts and per-request key lengths."""
    return {"actual_seq_qlen": list(query_start_loc[1:]), "actual_seq_kvlen": list(seq_lens)}


def _fia_caches(latent: Tensor, rope: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(latent [nb, bs, 1, 512], rope [nb, bs, 1, 64], block table): the caches themselves when they
    have the kernel's widths, else zero-padded copies of the blocks ``block_table`` names."""
    if latent.shape[-1] == LATENT and rope.shape[-1] == ROPE:
        return latent, rope, block_table
    blocks = block_table.reshape(-1).long()
    table = torch.arange(blocks.numel(), dtype=torch.int32, device=block_table.device).view(block_table.shape)
    return pad_last(latent[blocks], LATENT), pad_last(rope[blocks], ROPE), table


@OPS.implement
def mla_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Sequence[Tensor],
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    require_half("mla_decode", q_nope)
    num_tokens, heads, latent_width = q_nope.shape
    if latent_width > LATENT or q_pe.shape[-1] > ROPE:
        raise ValueError(f"mla_decode: the FIA MLA kernel takes a latent of {LATENT} and rope of {ROPE}")
    if max_query_len > MAX_QUERIES_PER_REQUEST:
        raise ValueError(
            f"mla_decode: {max_query_len} query tokens per request; the FIA MLA kernel takes at most "
            f"{MAX_QUERIES_PER_REQUEST}"
        )
    if num_tokens == 0:
        return q_nope.new_empty(0, heads, latent_width)
    latent, rope = kv_cache
    latent, rope, block_table = _fia_caches(latent, rope, block_table.to(torch.int32))
    query = pad_last(q_nope, LATENT)
    query_rope = pad_last(q_pe.to(q_nope.dtype), ROPE)
    kv_lens, starts = host_list(seq_lens), host_list(query_start_loc)
    if sliding_window is None:
        out = _decode(query, query_rope, latent, rope, block_table, kv_lens, starts, max_query_len, scale)
    else:
        out = _decode_windowed(
            query, query_rope, latent, rope, block_table, kv_lens, starts, scale, sliding_window
        )
    return out[:, :heads, :latent_width]


def _decode(
    query: Tensor,
    query_rope: Tensor,
    latent: Tensor,
    rope: Tensor,
    block_table: Tensor,
    kv_lens: list[int],
    starts: list[int],
    max_query_len: int,
    scale: float,
) -> Tensor:
    heads = next_power_of_two(query.shape[1])
    if heads > MAX_HEADS:
        raise ValueError(f"mla_decode: {query.shape[1]} heads; the FIA MLA kernel takes at most {MAX_HEADS}")
    num_blocks, block_size = latent.shape[:2]
    key = latent.view(num_blocks, 1, block_size, LATENT)
    kwargs = {
        "query_rope": pad_heads(query_rope, heads).contiguous(),
        "key_rope": rope.view(num_blocks, 1, block_size, ROPE),
        "block_table": block_table.contiguous(),
        "num_query_heads": heads,
        "num_key_value_heads": 1,
        "softmax_scale": scale,
        "input_layout": "TND",
        "block_size": block_size,
    }
    if max_query_len > 1:
        kwargs.update(sparse_mode=3, atten_mask=compressed_causal_mask(query.device))
    args = (pad_heads(query, heads).contiguous(), key, key)
    return fused_infer_attention(
        "npu_fused_infer_attention_score_v2", args, kwargs, tnd_lengths, kv_lens, starts
    )


def _decode_windowed(
    query: Tensor,
    query_rope: Tensor,
    latent: Tensor,
    rope: Tensor,
    block_table: Tensor,
    kv_lens: list[int],
    starts: list[int],
    scale: float,
    window: int,
) -> Tensor:
    npu = torch_npu()
    if torch.npu.is_current_stream_capturing():
        raise RuntimeError(
            "windowed mla_decode runs FIA v1, whose documented get_max_workspace takes no query_rope: it is "
            "not graph-capturable in this backend"
        )
    if query.shape[1] > MAX_HEADS:
        raise ValueError(f"windowed mla_decode: {query.shape[1]} heads; FIA v1's band mode takes {MAX_HEADS}")
    if max(kv_lens) > MAX_WINDOWED_KEYS:
        raise ValueError(f"windowed mla_decode: FIA v1's band mode takes at most {MAX_WINDOWED_KEYS} keys")
    counts = [b - a for a, b in itertools.pairwise(starts)]
    batch, longest = len(counts), max(counts)
    req = torch.tensor([b for b, n in enumerate(counts) for _ in range(n)], device=query.device)
    slot = torch.tensor([i for n in counts for i in range(n)], device=query.device)

    def batched(x: Tensor, width: int) -> Tensor:
        padded = x.new_zeros(batch, longest, MAX_HEADS, width)
        padded[req, slot] = pad_heads(x, MAX_HEADS)
        return padded

    num_blocks, block_size = latent.shape[:2]
    key = latent.view(num_blocks, block_size, LATENT)
    out, _ = npu.npu_fused_infer_attention_score(
        batched(query, LATENT),
        key,
        key,
        query_rope=batched(query_rope, ROPE),
        key_rope=rope.view(num_blocks, block_size, ROPE),
        atten_mask=compressed_causal_mask(query.device),
        actual_seq_lengths=counts,
        actual_seq_lengths_kv=kv_lens,
        block_table=block_table.contiguous(),
        num_heads=MAX_HEADS,
        num_key_value_heads=1,
        scale=scale,
        pre_tokens=window - 1,
        next_tokens=0,
        input_layout="BSND",
        sparse_mode=4,
        block_size=block_size,
    )
    return out[req, slot]
