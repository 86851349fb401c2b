"""Batch-invariant building blocks: the reference backend's deterministic-mode formulations use them.

A row's result must not depend on the other rows of its call. CPU BLAS breaks that through the row
count: MKL takes a different kernel for one row than for several, and blocks by the matrix shape, so
``(x @ w)[i]`` changes with ``len(x)``. Two rules remove the dependence:

- **Row counts in whole tiles.** Every product's row count is zero padded to a multiple of
  ``ROW_TILE``. MKL (2024.2, AVX2, 1 or 2 threads, measured here) rounds a product's row the same for
  any such row count and any column count above 8: it takes other kernels only for 1-5 rows or for at
  most 8 columns, which is what made ``(x @ w)[i]`` change with ``len(x)`` (a decode step's few rows
  against a prefill's many). A row's bits then depend only on its own values, never on the other rows
  or their number; this is a property of the BLAS, not of the code, so the conformance suite checks it
  on every machine it runs on (``deepinfer.backends.testing.invariance``), as does tests/determinism.
- **Fixed KV splits.** Attention cuts a request's keys at fixed positions (every ``KV_SPLIT`` keys, from
  position 0), subtracts each query row's maximum over all its keys (exact in any order), computes
  each split's weighted values and normaliser as one product, and adds the splits in ascending order
  (``index_add_`` adds its sources in index order). A query token's result depends only on its own keys, so
  it is the same computed alone (decode), with its request's other new tokens (a prompt chunk or a
  speculative verification), or after its prefix was read from the prefix cache.

- **Vector lanes only.** torch's CPU elementwise loops run two vectors at a time and finish the last few
  elements with scalar code, which rounds ``sigmoid`` and ``silu`` differently (exp, log and rsqrt
  agree); above 32768 elements the loop is also split between threads at a size-dependent point. So a
  row's activation would depend on where the batch's flat tensor ends. ``vector_lanes`` pads each call
  to a multiple of 64 elements and feeds at most 16384 at a time (single-threaded, no scalar tail).

Other elementwise arithmetic (+, *, /, exp) rounds the same in every lane and tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 16  # rows per matrix product
KV_SPLIT = 64  # keys per attention split
QUERY_BLOCK = 256  # rows of one long request per attention product


LANE_QUANTUM = 64  # a multiple of every vector loop step (AVX2/AVX-512, float32 and 16-bit types)
SERIAL_CHUNK = 16384  # below torch's 32768-element grain: one thread, one vector loop


def vector_lanes(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` for an elementwise ``fn``, with every element computed by the vectorised code path."""
    flat = x.contiguous().view(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, -n % LANE_QUANTUM))
    out = torch.cat([fn(chunk) for chunk in padded.split(SERIAL_CHUNK)]) if padded.numel() else padded
    return out[:n].view(x.shape)


def _padded(rows: Tensor) -> tuple[Tensor, int]:
    """[M, K] -> ([ceil(M / ROW_TILE) * ROW_TILE, K] zero padded and contiguous, M): the memory layout
    is part of the GEMM's path (MKL may take another one for strided operands)."""
    m = rows.shape[0]
    padded = -(-m // ROW_TILE) * ROW_TILE
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    return rows.contiguous(), m


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` for x [M, K], weight [N, K], rows padded to a multiple of ROW_TILE.
    Returns [M, N]."""
    rows, m = _padded(x)
    out = (rows @ weight.t())[:m]
    return out + bias if bias is not None else out


def tiled_grouped(x: Tensor, weight: Tensor, group_sizes: list[int]) -> Tensor:
    """Rows grouped by expert (``group_sizes[e]`` consecutive rows use ``weight[e]`` [N, K]) -> [M, N]:
    one product per expert over its rows, padded to a multiple of ROW_TILE (never shared with another
    expert's rows)."""
    if sum(group_sizes) != x.shape[0]:
        raise ValueError(f"group_sizes sum to {sum(group_sizes)}, but x has {x.shape[0]} rows")
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, size in enumerate(group_sizes):
        if size:
            out[start : start + size] = tiled_linear(x[start : start + size], weight[expert])
            start += size
    return out


def _cached_keys(
    key_sources: Sequence[Tensor],
    block_table: Tensor,
    block_size: int,
    req: Tensor,
    key_pos: Tensor,
    lens: Tensor,
) -> Tensor:
    """Keys of requests ``req`` [n] at positions ``key_pos`` [n, KV_SPLIT * k] (whole splits from a split
    boundary) -> [n, KV_SPLIT * k, W] float32; positions at or past a request's length are zero, whatever
    the cache holds there. Copies whole cache blocks when a split is made of whole blocks."""
    stored = key_pos < lens[req][:, None]
    device = key_sources[0].device
    if KV_SPLIT % block_size == 0:
        page = block_table[
            req[:, None], (key_pos[:, ::block_size] // block_size).clamp(max=block_table.shape[1] - 1)
        ]
        ids = page.reshape(-1).to(device)
        parts = [src.view(-1, block_size * src.shape[-1]).index_select(0, ids) for src in key_sources]
        parts = [part.view(-1, src.shape[-1]) for part, src in zip(parts, key_sources)]
    else:
        page = block_table[req[:, None], (key_pos // block_size).clamp(max=block_table.shape[1] - 1)]
        slots = (page * block_size + key_pos % block_size).reshape(-1).to(device)
        parts = [src.index_select(0, slots) for src in key_sources]
    keys = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).float()
    missing = (~stored).reshape(-1).nonzero().squeeze(1)
    if missing.numel():
        keys.index_fill_(0, missing.to(device), 0.0)
    return keys.view(*key_pos.shape, -1)


def _with_ones(keys: Tensor, latent: int) -> Tensor:
    """[..., KV_SPLIT, W] keys -> [..., KV_SPLIT, latent + 1] their values and a column of ones, so the
    product that weighs the values also sums the softmax weights (a separate product with one column
    would take a matrix-vector kernel, which rounds differently for one matrix than for a batch)."""
    return torch.cat((keys[..., :latent], keys.new_ones(*keys.shape[:-1], 1)), dim=-1)


def split_kv_attention(
    queries: Tensor,
    key_sources: Sequence[Tensor],
    block_table: Tensor,
    block_size: int,
    seq_lens: list[int],
    query_start_loc: list[int],
    latent: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """Absorbed MLA attention over a paged cache with fixed KV splits (the deterministic ``mla_decode``).

    queries: [T, H, W] float32; key_sources: the cache viewed as one row per slot, as one or more
    column groups ([N, W_1], [N, W_2], ...) whose concatenation, W wide, is the key in the queries'
    column order and whose first ``latent`` columns are the value; block_table: [B, M] block ids per
    request; query i of request b (``n_b`` queries) sits at position ``seq_lens[b] - n_b + i`` and sees
    keys ``j <= p`` (and ``j > p - window``). Returns [T, H, latent] float32.

    A request's (token, head) rows, zero padded to a multiple of ROW_TILE, are one block of queries.
    Their scores against the request's keys are one product of K = W; the softmax subtracts each row's
    maximum over all its keys (a maximum is exact in any order); the weighted values and the softmax
    normaliser are one ``[rows, KV_SPLIT] x [KV_SPLIT, latent + 1]`` product per split of KV_SPLIT keys
    (fixed positions from 0), and the splits are added in ascending order. Requests with at most
    ROW_TILE rows (decode, speculative verification) go through one batched product of
    ``[ROW_TILE, W] x [W, KV_SPLIT]`` per (request, split) pair instead, with the same arithmetic per
    row. A row's bits then depend only on its own query and keys, if a matrix product's row does not
    depend on the number of rows (a multiple of ROW_TILE) or of columns: true of MKL here and checked by
    the conformance suite and tests/determinism (it fails for 1-5 rows, hence the padding).
    """
    num_tokens, heads, width = queries.shape
    qsl = torch.tensor(query_start_loc, dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    table = block_table.long().cpu()
    rows_of = ((qsl[1:] - qsl[:-1]) * heads).tolist()
    q_rows = queries.reshape(-1, width)
    result = queries.new_empty(num_tokens * heads, latent)
    short = [b for b, n in enumerate(rows_of) if 0 < n <= ROW_TILE]
    if short:
        _short_requests(
            q_rows, result, short, key_sources, table, block_size, qsl, lens, heads, scale, window
        )
    for b, n in enumerate(rows_of):
        if n > ROW_TILE:
            rows = slice(query_start_loc[b] * heads, query_start_loc[b + 1] * heads)
            result[rows] = _long_request(
                q_rows[rows], key_sources, table, block_size, b, lens, heads, latent, scale, window
            )
    return result.view(num_tokens, heads, latent)


def _visible(scores: Tensor, key_pos: Tensor, pos: Tensor, window: int | None) -> Tensor:
    """scores [..., rows, keys] with the keys a row may not see (past its position, or out of its
    window) set to -inf, in place; key_pos [..., 1, keys] and pos [..., rows, 1] broadcast."""
    hidden = key_pos > pos
    if window is not None:
        hidden |= key_pos <= pos - window
    return scores.masked_fill_(hidden.to(scores.device), float("-inf"))


def _long_request(
    q: Tensor,
    key_sources: Sequence[Tensor],
    table: Tensor,
    block_size: int,
    b: int,
    lens: Tensor,
    heads: int,
    latent: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """One request's rows q [n, W] (n > ROW_TILE) -> [n, latent], QUERY_BLOCK rows at a time, each block
    against the keys up to its last row's position (causal: later splits hold nothing it sees)."""
    n = q.shape[0]
    length = int(lens[b])
    first_pos = length - n // heads
    splits = -(-length // KV_SPLIT)
    all_keys = _cached_keys(
        key_sources, table, block_size, torch.tensor([b]), torch.arange(splits * KV_SPLIT)[None], lens
    )[0]
    values = _with_ones(all_keys, latent).view(splits, KV_SPLIT, latent + 1)
    out = q.new_empty(n, latent)
    for start in range(0, n, QUERY_BLOCK):
        rows = min(QUERY_BLOCK, n - start)
        padded = -(-rows // ROW_TILE) * ROW_TILE
        block = F.pad(q[start : start + rows], (0, 0, 0, padded - rows))
        row_pos = (first_pos + (start + torch.arange(padded)) // heads).clamp(
            max=first_pos + (start + rows - 1) // heads
        )
        seen = int(row_pos[-1]) // KV_SPLIT + 1  # splits up to the block's last position
        keys = all_keys[: seen * KV_SPLIT]
        scores = _visible(
            (block @ keys.t()).mul_(scale), torch.arange(seen * KV_SPLIT)[None], row_pos[:, None], window
        )
        weights = torch.exp(scores - scores.amax(dim=1, keepdim=True))
        per_split = torch.bmm(weights.view(padded, seen, KV_SPLIT).transpose(0, 1), values[:seen])
        acc = per_split.new_zeros(1, padded, latent + 1)
        acc.index_add_(
            0, torch.zeros(seen, dtype=torch.int64, device=q.device), per_split
        )  # ascending splits
        out[start : start + rows] = acc[0, :rows, :latent] / acc[0, :rows, latent:]
    return out


def _short_requests(
    q_rows: Tensor,
    result: Tensor,
    reqs: list[int],
    key_sources: Sequence[Tensor],
    table: Tensor,
    block_size: int,
    qsl: Tensor,
    lens: Tensor,
    heads: int,
    scale: float,
    window: int | None,
) -> None:
    """Requests with at most ROW_TILE rows each: one zero-padded tile per request, all (request, split)
    pairs through one batched product; writes their rows of ``result`` [T * H, latent]."""
    device = q_rows.device
    width, latent = q_rows.shape[1], result.shape[1]
    req = torch.tensor(reqs, dtype=torch.int64)
    n_tiles = len(reqs)
    first_row = qsl[req] * heads
    in_tile = torch.arange(ROW_TILE)
    real = in_tile[None, :] < ((qsl[req + 1] - qsl[req]) * heads)[:, None]  # [n_tiles, ROW_TILE]
    flat_row = first_row[:, None] + in_tile
    # A row's token position; padding rows take the request's last position (a finite softmax).
    row_pos = torch.where(
        real, lens[req][:, None] - (qsl[req + 1][:, None] - flat_row // heads), lens[req][:, None] - 1
    )
    splits_of = -(-lens[req] // KV_SPLIT)
    pair_tile = torch.repeat_interleave(torch.arange(n_tiles), splits_of)
    pair_split = torch.arange(pair_tile.numel()) - torch.repeat_interleave(
        splits_of.cumsum(0) - splits_of, splits_of
    )
    key_pos = pair_split[:, None] * KV_SPLIT + torch.arange(KV_SPLIT)  # [P, KV_SPLIT]
    keys = _cached_keys(key_sources, table, block_size, req[pair_tile], key_pos, lens)  # [P, KV_SPLIT, W]
    q_tiles = q_rows.index_select(0, torch.where(real, flat_row, 0).reshape(-1).to(device)).view(
        n_tiles, ROW_TILE, width
    )
    pair_dev = pair_tile.to(device)
    scores = torch.bmm(q_tiles.index_select(0, pair_dev), keys.transpose(1, 2)).mul_(scale)
    _visible(scores, key_pos[:, None, :], row_pos[pair_tile][:, :, None], window)
    top = scores.new_full((n_tiles, ROW_TILE), float("-inf"))
    top.scatter_reduce_(0, pair_dev[:, None].expand(-1, ROW_TILE), scores.amax(dim=-1), "amax")
    weights = torch.exp(scores - top.index_select(0, pair_dev)[..., None])
    acc = scores.new_zeros(n_tiles, ROW_TILE, latent + 1)
    acc.index_add_(0, pair_dev, torch.bmm(weights, _with_ones(keys, latent)))  # a tile's splits, ascending
    out = acc[..., :latent] / acc[..., latent:]
    result[flat_row[real].to(device)] = out[real.to(device)]
