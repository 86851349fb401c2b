"""The fast CPU backend in deterministic mode: its batch-invariant attention kernel and grouped expert
products, and which of its other kernels are batch-invariant as they are (the rest run the reference's
invariant formulations).

The engine sends every token through ``mla_decode`` in this mode (prompt chunks too), so a token's
attention is one computation whether it is decoded, part of a prompt chunk, a speculative draft being
verified, or follows a prefix read from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.moe import _grouped
from deepinfer.backends.cpu.native import load
from deepinfer.backends.cpu.norm import silu_and_mul
from deepinfer.backends.reference.invariant import ROW_TILE

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


def _padded_rows(group_of_row: Tensor, num_groups: int) -> tuple[Tensor, Tensor, int]:
    """Rows sorted by group (``group_of_row`` [M], ascending) -> (destination of each row [M] in a layout
    where every group's rows start at a multiple of ROW_TILE and its row count is zero padded to one,
    the padded groups' ends [G] int32, the padded row count)."""
    sizes = torch.bincount(group_of_row, minlength=num_groups)
    padded = -(-sizes // ROW_TILE) * ROW_TILE
    ends = padded.cumsum(0)
    first = (sizes.cumsum(0) - sizes)[group_of_row]
    rank = torch.arange(group_of_row.numel(), device=group_of_row.device) - first
    return (ends - padded)[group_of_row] + rank, ends.to(torch.int32), int(ends[-1])


def _padded_grouped(x: Tensor, src: Tensor, dest: Tensor, ends: Tensor, total: int, weight: Tensor) -> Tensor:
    """Rows ``x[src]`` placed at ``dest`` of a [total, K] layout whose other rows are zero, times their
    group's weight (``ends``: the padded groups' ends) -> [total, N]."""
    pick = torch.full((total,), x.shape[0], dtype=torch.int64, device=x.device)  # row x.shape[0]: zeros
    pick[dest] = src
    rows = torch.cat((x, x.new_zeros(1, x.shape[1]))).index_select(0, pick)
    return _grouped(rows, weight, ends)


ONE_SHAPE_PER_EXPERT = (
    f"one grouped product in which every expert's rows start at a multiple of {ROW_TILE} and are zero "
    f"padded to one (each expert's product then rounds a row the same whatever its row count)"
)


@OPS.implement_invariant(ONE_SHAPE_PER_EXPERT)
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    if int(group_sizes.sum()) != x.shape[0]:
        raise ValueError(f"group_sizes sum to {int(group_sizes.sum())}, but x has {x.shape[0]} rows")
    groups = torch.arange(weight.shape[0], device=x.device)
    dest, ends, total = _padded_rows(torch.repeat_interleave(groups, group_sizes.long()), weight.shape[0])
    rows = torch.arange(x.shape[0], device=x.device)
    return _padded_grouped(x, rows, dest, ends, total, weight).index_select(0, dest)


@OPS.implement_invariant(
    ONE_SHAPE_PER_EXPERT
    + "; the native silu_and_mul (invariant as it is); each token's k expert outputs are "
    "added in "
    "ascending expert id order"
)
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    ids, slot = topk_ids.long().sort(dim=1, stable=True)  # remote experts (id < 0) first: they add 0
    weights = topk_weights.float().gather(1, slot)
    expert_of_pair = ids.reshape(-1)
    local = expert_of_pair >= 0
    order = torch.argsort(torch.where(local, expert_of_pair, num_experts), stable=True)
    pairs = order[: int(local.sum())]
    dest, ends, total = _padded_rows(expert_of_pair[pairs], num_experts)
    gate_up = _padded_grouped(hidden, pairs // top_k, dest, ends, total, w13)
    expert_out = _grouped(silu_and_mul(gate_up), w2, ends)
    row_of_pair = torch.zeros(num_tokens * top_k, dtype=torch.int64, device=hidden.device)
    row_of_pair[pairs] = dest
    per_pair = expert_out.index_select(0, row_of_pair).float()
    if pairs.numel() < expert_of_pair.numel():
        per_pair.masked_fill_(~local[:, None], 0.0)  # another rank's experts
    per_pair = per_pair.view(num_tokens, top_k, -1)
    out = weights[:, 0, None] * per_pair[:, 0]
    for j in range(1, top_k):
        out += weights[:, j, None] * per_pair[:, j]
    return out.to(hidden.dtype)
