"""Reference MLA attention: expanded varlen prefill and absorbed paged decode."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.reference import OPS


def _allowed(query_pos: Tensor, key_pos: Tensor, kv_len: Tensor | int, window: int | None) -> Tensor:
    """Mask [..., Q, S]: key position s is visible from query position p (causal, window, length)."""
    mask = (key_pos[..., None, :] <= query_pos[..., :, None]) & (key_pos[..., None, :] < kv_len)
    if window is not None:
        mask &= key_pos[..., None, :] > (query_pos[..., :, None] - window)
    return mask


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
    v_dim = v.shape[-1]
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    # torch's fused CPU attention kernel needs values as wide as keys; pad them and drop the padding.
    if v_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - v_dim))
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        # [1, H, S, D]: torch's CPU SDPA takes its fused kernel only for 4-D inputs (3-D falls back to
        # the unfused math path, about 4x slower).
        qb = q[q0:q1].transpose(0, 1).float()[None]
        kb = k[k0:k1].transpose(0, 1).float()[None]
        vb = v[k0:k1].transpose(0, 1).float()[None]
        if len_q == len_k and sliding_window is None:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            query_pos = torch.arange(len_k - len_q, len_k, device=q.device)
            mask = _allowed(query_pos, torch.arange(len_k, device=q.device), len_k, sliding_window)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out[q0:q1] = ob[0].transpose(0, 1)[..., :v_dim].to(out.dtype)
    return out


# Queries per score block of ``mla_prefill_partial``: scores are [H, QUERY_BLOCK, len_k] float32.
QUERY_BLOCK = 128


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
    tokens, heads = q.shape[0], q.shape[1]
    out = torch.zeros(tokens, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0 or len_k == 0:
            continue
        if causal and len_k < len_q:
            raise ValueError(f"mla_prefill_partial: causal request {b} has {len_k} keys < {len_q} queries")
        kb = k[k0:k1].transpose(0, 1).float()  # [H, len_k, D]
        vb = v[k0:k1].transpose(0, 1).float()
        for s in range(0, len_q, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, len_q)
            scores = torch.matmul(q[q0 + s : q0 + e].transpose(0, 1).float(), kb.transpose(1, 2)) * scale
            if causal:
                query_pos = torch.arange(len_k - len_q + s, len_k - len_q + e, device=q.device)
                mask = _allowed(query_pos, torch.arange(len_k, device=q.device), len_k, None)
                scores.masked_fill_(~mask, float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)  # [H, n], finite: every query sees a key
            probs = torch.exp(scores - block_lse[..., None])
            out[q0 + s : q0 + e] = torch.matmul(probs, vb).transpose(0, 1)
            lse[q0 + s : q0 + e] = block_lse.transpose(0, 1)
    return out, lse


OPS.declare_invariant(
    ["mla_prefill_partial"],
    "one computation per request and query block, so batch mates never share its arithmetic; NOT "
    "invariant to how the context is tiled (deterministic mode runs every token through mla_decode)",
)


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
    block_size, width = cache.shape[1], cache.shape[2]
    latent = q_nope.shape[-1]
    num_tokens, heads = q_nope.shape[0], q_nope.shape[1]
    num_reqs = seq_lens.shape[0]
    device = q_nope.device
    seq_lens = seq_lens.long()

    # Gather every request's blocks into a padded [B, S, L + R] batch (whole blocks: fast copies).
    # Rows past a request's length may hold garbage (even NaN) and must be finite for the masked-out
    # products to vanish: unused table entries read the request's first block instead (all real rows
    # once the request has a full block), and the few rows that remain stale are zeroed.
    num_blocks = -(-int(seq_lens.max()) // block_size)
    span = num_blocks * block_size
    key_pos = torch.arange(span, device=device)
    own_blocks = -(-seq_lens // block_size)
    used = torch.arange(num_blocks, device=device)[None, :] < own_blocks[:, None]
    table = block_table[:, :num_blocks].long()
    table = torch.where(used, table, table[:, :1])
    keys = cache.index_select(0, table.reshape(-1)).view(num_reqs, span, width).float()
    real = key_pos[None, :] < seq_lens[:, None]
    real |= ~used.repeat_interleave(block_size, dim=1) & (key_pos % block_size < seq_lens[:, None])
    stale_req, stale_pos = (~real).nonzero(as_tuple=True)
    if stale_req.numel():
        keys[stale_req, stale_pos] = 0.0

    # Place queries in a padded [B, Qmax, H, L + R] batch.
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    queries = torch.cat((q_nope, q_pe), dim=-1).float()
    if max_query_len == 1 and num_tokens == num_reqs:
        padded = queries[:, None]
        req_of_token = token_slot = None
    else:
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_slot = torch.arange(num_tokens, device=device) - query_start_loc.long()[req_of_token]
        padded = queries.new_zeros(num_reqs, max_query_len, heads, width)
        padded[req_of_token, token_slot] = queries
    query_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]

    rows = max_query_len * heads
    scores = torch.bmm(padded.reshape(num_reqs, rows, width), keys.transpose(1, 2)).mul_(scale)
    mask = _allowed(query_pos, key_pos, seq_lens[:, None, None], sliding_window)
    scores = scores.view(num_reqs, max_query_len, heads, span).masked_fill_(
        ~mask[:, :, None, :], float("-inf")
    )
    probs = torch.softmax(scores.view(num_reqs, rows, span), dim=-1).nan_to_num_(0.0)
    out = torch.bmm(probs, keys[..., :latent]).view(num_reqs, max_query_len, heads, latent)
    if req_of_token is None:
        return out[:, 0].to(q_nope.dtype)
    return out[req_of_token, token_slot].to(q_nope.dtype)
