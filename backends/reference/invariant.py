"""Batch-invariant building blocks: the reference backend's deterministic-mode formulations use them.

A row's result must not depend on the other rows of its call. CPU BLAS breaks that through the row
count: MKL takes a different kernel for one row than for several, and blocks by the matrix shape, so
``(x @ w)[i]`` changes with ``len(x)``. Two rules remove the dependence:

- **One GEMM shape.** Every product is cut into tiles of ``ROW_TILE`` rows (the last one zero padded)
  and each tile goes through the same ``[ROW_TILE, K] x [K, N]`` matrix product (``torch.bmm`` over a
  batch of tiles). A row's bits then depend only on its own values, never on its neighbours in the tile
  or on how many tiles there are (the conformance suite checks both).
- **Fixed KV splits.** Attention cuts a request's keys at fixed positions (every ``KV_SPLIT`` keys, from
  position 0), computes each split's maximum, normaliser and weighted values with the fixed GEMM shape,
  and combines the splits in ascending order. A query token's result depends only on its own keys, so
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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 16  # rows per matrix product
KV_SPLIT = 64  # keys per attention split


LANE_QUANTUM = 64  # a multiple of every vector loop step (AVX2/AVX-512, float32 and 16-bit types)
SERIAL_CHUNK = 16384  # below torch's 32768-element grain: one thread, one vector loop


def vector_lanes(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` for an elementwise ``fn``, with every element computed by the vectorised code path."""
    flat = x.contiguous().view(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, -n % LANE_QUANTUM))
    out = torch.cat([fn(chunk) for chunk in padded.split(SERIAL_CHUNK)]) if padded.numel() else padded
    return out[:n].view(x.shape)


def _tiles(rows: Tensor) -> tuple[Tensor, int]:
    """[M, K] -> ([ceil(M / ROW_TILE), ROW_TILE, K] zero padded and contiguous, M): the memory layout
    is part of the GEMM shape (MKL may take another path for strided operands)."""
    m = rows.shape[0]
    padded = -(-m // ROW_TILE) * ROW_TILE
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    return rows.contiguous().view(-1, ROW_TILE, rows.shape[-1]), m


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` for x [M, K], weight [N, K], through the fixed tile shape. Returns [M, N]."""
    tiles, m = _tiles(x)
    out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], -1, -1)).reshape(-1, weight.shape[0])[:m]
    return out + bias if bias is not None else out


def tiled_grouped(x: Tensor, weight: Tensor, group_sizes: list[int]) -> Tensor:
    """Rows grouped by expert (``group_sizes[e]`` consecutive rows use ``weight[e]`` [N, K]) -> [M, N].

    Tiles never straddle two experts; all tiles go through the fixed shape in one batched product."""
    tiles, experts, keep, start = [], [], [], 0
    for expert, size in enumerate(group_sizes):
        if size:
            t, _ = _tiles(x[start : start + size])
            tiles.append(t)
            experts += [expert] * t.shape[0]
            keep.append(torch.arange(t.shape[0] * ROW_TILE, device=x.device) < size)
            start += size
    if start != x.shape[0]:
        raise ValueError(f"group_sizes sum to {start}, but x has {x.shape[0]} rows")
    if not tiles:
        return x.new_empty(0, weight.shape[1])
    index = torch.tensor(experts, device=x.device)
    products = torch.bmm(torch.cat(tiles), weight.index_select(0, index).transpose(1, 2))
    return products.reshape(-1, weight.shape[1])[torch.cat(keep)]


def gather_keys(
    latent_rows: Tensor, rope_rows: Tensor, block_table: Tensor, seq_lens: list[int], block_size: int
) -> Tensor:
    """Each request's cached rows in position order, as ``split_kv_attention`` reads them.

    latent_rows [N, L] / rope_rows [N, R]: the cache viewed as one row per slot; block_table [B, M].
    Returns [B, S, R + L + 1] float32, S = the longest request rounded up to KV_SPLIT; rows at or past a
    request's length are zero (whatever the cache holds there)."""
    device = latent_rows.device
    span = -(-max(seq_lens) // KV_SPLIT) * KV_SPLIT
    pos = torch.arange(span, device=device)
    lens = torch.tensor(seq_lens, device=device)
    valid = pos[None, :] < lens[:, None]
    page = block_table.long()[:, (pos // block_size).clamp(max=block_table.shape[1] - 1)]
    slots = torch.where(valid, page * block_size + pos % block_size, 0).reshape(-1)
    rows = torch.cat(
        (
            rope_rows.index_select(0, slots).float(),
            latent_rows.index_select(0, slots).float(),
            torch.ones(slots.numel(), 1, device=device),
        ),
        dim=-1,
    )
    return torch.where(valid.reshape(-1, 1), rows, 0.0).view(len(seq_lens), span, -1)


def split_kv_attention(
    queries: Tensor,
    keys: Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    latent: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """Absorbed MLA attention with fixed KV splits (the deterministic ``mla_decode``).

    queries: [T, H, W] float32 with W = R + L laid out ``[rope | latent]``; keys: [B, S, W + 1] float32,
    request b's cached rows in position order laid out ``[rope | latent | 1]`` (S a multiple of
    KV_SPLIT, rows at or past ``seq_lens[b]`` zero); the value of a key is its latent part, and the
    trailing 1 makes the same product that weighs the values also sum the softmax weights. Query i of
    request b (``n_b`` queries) sits at position ``seq_lens[b] - n_b + i``. Returns [T, H, L] float32.
    """
    num_tokens, heads, width = queries.shape
    device = queries.device
    # Query tiles: each request's (token, head) rows, ROW_TILE at a time; tiles never straddle requests.
    tile_rows, tile_req = [], []
    for b in range(len(seq_lens)):
        q0, q1 = query_start_loc[b], query_start_loc[b + 1]
        rows = torch.arange(q0 * heads, q1 * heads)
        padded = -(-rows.numel() // ROW_TILE) * ROW_TILE
        tile_rows.append(F.pad(rows, (0, padded - rows.numel()), value=-1))
        tile_req += [b] * (padded // ROW_TILE)
    flat_row = torch.cat(tile_rows).view(-1, ROW_TILE)  # [n_tiles, ROW_TILE] row index, -1 = padding
    req = torch.tensor(tile_req, dtype=torch.int64)
    real = flat_row >= 0
    token = torch.where(real, flat_row // heads, 0)
    qsl = torch.tensor(query_start_loc, dtype=torch.int64)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    query_pos = lens[req][:, None] - (qsl[req + 1][:, None] - token)  # [n_tiles, ROW_TILE]
    query_pos = torch.where(real, query_pos, -1)

    # (tile, split) pairs: a tile visits the splits up to the one holding its last query's position.
    splits_of_tile = query_pos.max(dim=1).values // KV_SPLIT + 1
    most = int(splits_of_tile.max())
    pair_tile = torch.repeat_interleave(torch.arange(len(tile_req)), splits_of_tile)
    pair_split = torch.arange(pair_tile.numel()) - torch.repeat_interleave(
        splits_of_tile.cumsum(0) - splits_of_tile, splits_of_tile
    )

    q_rows = torch.cat((queries.reshape(-1, width), queries.new_zeros(1, width)))
    q_tiles = q_rows[torch.where(real, flat_row, q_rows.shape[0] - 1)].to(device)
    key_splits = keys.view(keys.shape[0], -1, KV_SPLIT, keys.shape[-1])
    k_pairs = key_splits[req[pair_tile].to(device), pair_split.to(device)]  # [P, KV_SPLIT, W + 1]
    scores = torch.bmm(q_tiles[pair_tile.to(device)], k_pairs[..., :width].transpose(1, 2)).mul_(scale)

    key_pos = (pair_split[:, None] * KV_SPLIT + torch.arange(KV_SPLIT))[:, None, :]
    pos = query_pos[pair_tile][:, :, None]
    visible = (key_pos <= pos) & (pos >= 0)
    if window is not None:
        visible &= key_pos > pos - window
    scores.masked_fill_(~visible.to(device), float("-inf"))
    split_max = scores.amax(dim=-1)  # [P, ROW_TILE]; -inf where the row sees no key of the split
    finite_max = torch.where(torch.isinf(split_max), 0.0, split_max)
    weights = torch.exp(scores - finite_max[..., None])
    values = torch.bmm(weights, k_pairs[..., width - latent :])  # [P, ROW_TILE, L + 1]

    # Combine the splits of each tile in ascending order.
    dense_max = split_max.new_full((len(tile_req), most, ROW_TILE), float("-inf"))
    dense_max[pair_tile, pair_split] = split_max
    dense_val = values.new_zeros(len(tile_req), most, ROW_TILE, latent + 1)
    dense_val[pair_tile, pair_split] = values
    top = dense_max.amax(dim=1)
    top = torch.where(torch.isinf(top), 0.0, top)
    acc = values.new_zeros(len(tile_req), ROW_TILE, latent + 1)
    for j in range(most):
        acc += torch.exp(dense_max[:, j] - top)[..., None] * dense_val[:, j]
    out = (acc[..., :latent] / acc[..., latent:]).reshape(-1, latent)
    result = queries.new_empty(num_tokens * heads, latent)
    result[flat_row[real].to(device)] = out[real.reshape(-1).to(device)]
    return result.view(num_tokens, heads, latent)
