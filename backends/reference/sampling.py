"""Reference sampling: temperature, top-k, top-p, min-p, greedy, and counter-based seeded noise.

The noise is a pure function of (seed, offset, token id), so a request's tokens depend only on its own
seed and position: the same whatever else is in the batch, and the same on every backend that
implements ``counter_uniform`` bit-exactly (it uses only 32-bit integer arithmetic held in int64, with
multiplications split into 16-bit halves so that no intermediate overflows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.backends.reference import OPS

_M16 = 0xFFFF
_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    return (x * (c & _M16) + (((x * (c >> 16)) & _M16) << 16)) & _M32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: Tensor, offsets: Tensor, vocab_size: int) -> Tensor:
    """Uniform noise in (0, 1): [B, vocab_size] float32, a pure function of (seed, offset, token).

    ``key = mix32(mix32(seed_lo ^ mix32(seed_hi)) ^ offset_lo)``; ``h = mix32(key ^ mix32(token))``;
    ``u = ((h >> 9) + 0.5) / 2**23`` (23 bits, exact in float32, so u lies in [2**-24, 1 - 2**-24]; with
    24 bits the upper half would round and the largest hash would give u == 1, infinite noise).
    """
    seeds = seeds.long()
    seed_key = mix32((seeds & _M32) ^ mix32((seeds >> 32) & _M32))
    key = mix32(seed_key ^ (offsets.long() & _M32))
    tokens = mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    h = mix32(key[:, None] ^ tokens[None, :])
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def allowed_tokens(probs: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Bool mask [B, V] of tokens that pass top-k, top-p (on the top-k renormalised distribution) and
    min-p, as specified by ``deepinfer.backends.ops.sample``."""
    vocab = probs.shape[1]
    mask = torch.ones_like(probs, dtype=torch.bool)
    if bool((min_p > 0).any()):
        mask &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=probs.device)
        k = torch.where(top_k > 0, top_k.long(), vocab)
        keep = rank[None, :] < k[:, None]
        kept = sorted_probs * keep
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = kept.cumsum(dim=-1) - kept
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)  # 1 = off, even if the sum rounds
        mask &= torch.zeros_like(mask).scatter_(1, order, keep)
    return mask


@OPS.implement
def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
) -> Tensor:
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    random_rows = (temperature > 0).nonzero().squeeze(1)
    if random_rows.numel() == 0:
        return tokens
    rows = logits.index_select(0, random_rows) / temperature.index_select(0, random_rows)[:, None]
    log_probs = torch.log_softmax(rows, dim=-1)
    allowed = allowed_tokens(
        log_probs.exp(),
        top_k.index_select(0, random_rows),
        top_p.index_select(0, random_rows),
        min_p.index_select(0, random_rows),
    )
    u = counter_uniform(
        seeds.index_select(0, random_rows), offsets.index_select(0, random_rows), rows.shape[1]
    )
    gumbel = -torch.log(-torch.log(u))
    perturbed = (log_probs + gumbel).masked_fill(~allowed, float("-inf"))
    tokens[random_rows] = perturbed.argmax(dim=-1)
    return tokens


@OPS.implement
def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    vocab = logits.shape[1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).flatten(1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


@OPS.implement
def greedy(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)
