"""Paged MLA decode for the CPU: each cached row read once, in place, with an online softmax.

The native kernel (``csrc/kernels.cpp``, ``mla_decode``) splits every request's visible keys into
runs of whole blocks (about four per thread over the batch, at least four blocks each), walks each run
block by block through the block table, and keeps per (query token, head) a running max, a running sum
of exponentials and an unnormalised float32 output; the runs of one request are merged by their
log-sum-exp. Nothing is gathered or padded, workspace is O(splits x queries x heads x L), and
several query tokens per request (speculative verification) and sliding windows are handled by the
per-query causal/window test. Rows past a request's length, and blocks it does not own, are never read.
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
