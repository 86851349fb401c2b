"""The fast CPU backend in deterministic mode: its batch-invariant attention kernel, and which of its
other kernels are batch-invariant as they are (the rest run the reference's invariant formulations).

The engine sends every token through ``mla_decode`` in this mode (prompt chunks too), so a token's
attention is one computation whether it is decoded, part of a prompt chunk, a speculative draft being
verified, or follows a prefix read from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()


@OPS.implement_invariant(
    "native kernel: each query row runs one online softmax over key tiles cut at fixed positions (every "
    "16 keys from position 0, and at cache block boundaries) in ascending order, multiplying only the keys "
    "up to its own position; rows are scored in zero-padded groups by one code path, no split along the "
    "KV and no cross-row reduction: a query token's bits depend only on its own query and keys"
)
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
    return _native.mla_decode_invariant(
        q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, scale, sliding_window or 0
    )


OPS.declare_invariant(
    ["rms_norm", "add_rms_norm"],
    "native kernel: one pass per row; the sum of squares in an order fixed by the hidden size (16 lanes "
    "in index order, then the lanes in order), whatever thread or batch the row is in",
)
OPS.declare_invariant(
    ["rope"], "native kernel: elementwise per (token, head) row, the same code for every row"
)
