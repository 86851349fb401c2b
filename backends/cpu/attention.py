"""MLA attention for the CPU: paged decode over the latent cache, and expanded prefill.

- ``mla_decode`` (``csrc/kernels.cpp``): each cached row read once, in place through the block table
  (the next tile's rows prefetched), with an online softmax over tiles of 16 keys. A work item is a
  block of one request's (query token, head) rows against a range of its keys; a request's keys are
  split into ranges merged by log-sum-exp only when the batch alone cannot keep the threads busy. Nothing
  is gathered or padded, workspace is O(items x rows x L), and several query tokens per request
  (speculative verification) and sliding windows are handled by the per-query causal/window test. Rows
  past a request's length, and blocks it does not own, are never read.
- ``mla_prefill`` / ``mla_prefill_partial`` (``csrc/prefill.cpp``): flash attention over (request,
  head, block of 64 queries) work items, keys in blocks of 64 scored four queries at a time, an online
  softmax in float32, inputs read in place. torch's fused SDPA (the reference's) needs the values padded
  to the key width, a 4-D copy per request and, for a chunk that continues a prompt, a materialised
  mask that sends it down a slower path.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()


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
    (cache,) = kv_cache
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return _native.mla_decode(
        q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, scale, sliding_window or 0
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
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return _native.mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sliding_window or 0)


@OPS.implement
def mla_prefill_partial(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    return _native.mla_prefill_partial(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


OPS.declare_invariant(
    ["mla_prefill", "mla_prefill_partial"],
    "native kernel: work items are (request, head, block of 64 queries), so batch mates never share "
    "arithmetic; NOT invariant to how a prompt is chunked or its context tiled (deterministic mode runs "
    "every token through mla_decode)",
)
