"""Sampling in one kernel per row: temperature, top-k, top-p, min-p and seeded Gumbel-max, no sort.

Every filter keeps a prefix of the vocabulary ordered by descending probability (ties by lower id), so
the allowed set is ``{q > cut} + the first few ids whose q equals the next value below``. The cut is
found by a 16-way search over the bit pattern of the float32 probabilities (monotone for non-negative
floats): each pass over the row counts, for 16 pivots at once, the tokens at or above the pivot, their
mass, their smallest q and the largest q below, which is all the top-k and top-p predicates need; eight
passes pin a cut exactly. A last pass draws ``argmax(log p + g)`` over the allowed tokens with
``g = -log(-log(u))`` and u the counter-based uniform of ``deepinfer.backends.reference.sampling``,
hashed in uint32 arithmetic (which wraps exactly as the reference's split 16-bit products do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.backends.reference.sampling import mix32
from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.runtime import check_device, pow2

_M32 = 0xFFFFFFFF
_PIVOTS = 16


@triton.jit
def _mix32(x):
    """Wellons' lowbias32 on uint32 values (``reference.sampling.mix32`` bit for bit)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def counter_uniform_tile(key, cols):
    """u in (0, 1) for the uint32 per-row key and int32 token ids ``cols``, as ``counter_uniform``."""
    h = _mix32(key ^ _mix32(cols.to(tl.uint32)))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _log_probs(row_ptr, cols, col_ok, temperature, lse):
    z = tl.math.div_rn(tl.load(row_ptr + cols, mask=col_ok, other=float("-inf")), temperature)
    return z - lse


@triton.jit
def _search_cut(
    row_ptr, V, temperature, lse, k_limit, mass_limit, lo, q_max, BLOCK: tl.constexpr, PIVOTS: tl.constexpr
):
    """The smallest bit pattern ``cut`` such that the set {q >= cut} is wholly kept: at most k_limit
    tokens, and the mass before its last member below mass_limit. Returns (cut, its count, its mass,
    the largest q below it). ``lo`` is a pattern known to fail."""
    hi = tl.full([], 0x3F800001, tl.int32)  # just above 1.0: no probability reaches it
    count_hi = tl.full([], 0, tl.int32)
    mass_hi = tl.full([], 0.0, tl.float32)
    below_hi = q_max
    idx = tl.arange(0, PIVOTS)
    while hi - lo > 1:
        span = (hi - lo).to(tl.int64)
        pivot = (lo + ((idx + 1).to(tl.int64) * span) // (PIVOTS + 1)).to(tl.int32)
        count = tl.zeros([PIVOTS], tl.int32)
        mass = tl.zeros([PIVOTS], tl.float32)
        least = tl.full([PIVOTS], float("inf"), tl.float32)
        below = tl.zeros([PIVOTS], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_ok = cols < V
            q = tl.exp(_log_probs(row_ptr, cols, col_ok, temperature, lse))
            at_or_above = (q.to(tl.int32, bitcast=True)[:, None] >= pivot[None, :]) & col_ok[:, None]
            q2 = q[:, None] + tl.zeros([BLOCK, PIVOTS], tl.float32)
            count += tl.sum(at_or_above.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(at_or_above, q2, 0.0), axis=0)
            least = tl.minimum(least, tl.min(tl.where(at_or_above, q2, float("inf")), axis=0))
            below = tl.maximum(below, tl.max(tl.where(at_or_above | ~col_ok[:, None], 0.0, q2), axis=0))
        before_last = mass - tl.where(count > 0, least, 0.0)
        kept = (count <= k_limit) & (before_last < mass_limit)
        new_hi = tl.min(tl.where(kept, pivot, hi), axis=0)
        pick = tl.min(tl.where(kept & (pivot == new_hi), idx, PIVOTS), axis=0)
        found = pick < PIVOTS
        count_hi = tl.where(found, tl.sum(tl.where(idx == pick, count, 0), axis=0), count_hi)
        mass_hi = tl.where(found, tl.sum(tl.where(idx == pick, mass, 0.0), axis=0), mass_hi)
        below_hi = tl.where(found, tl.sum(tl.where(idx == pick, below, 0.0), axis=0), below_hi)
        lo = tl.max(tl.where(~kept & (pivot < new_hi), pivot, lo), axis=0)
        hi = new_hi
    return hi, count_hi, mass_hi, below_hi, lo


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    key_ptr,
    out_ptr,
    V,
    stride_row,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    if temperature > 0.0:
        # Softmax statistics of logits / temperature.
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _log_probs(row_ptr, cols, cols < V, temperature, 0.0)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)
            m = m_new
        lse = m + tl.log(s)
        q_max = tl.exp(m - lse)

        # The cut: keep {q >= cut} and the first `take` ids whose q equals `tie` (the next value below).
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        k_limit = tl.where((top_k > 0) & (top_k < V), top_k, V)
        cut = tl.full([], 0, tl.int32)
        tie = tl.full([], -1.0, tl.float32)
        take = tl.full([], 0, tl.int32)
        kept_mass = tl.full([], 1.0, tl.float32)
        lo = tl.full([], -1, tl.int32)
        if k_limit < V:
            cut, count, mass, tie, lo = _search_cut(
                row_ptr, V, temperature, lse, k_limit, float("inf"), lo, q_max, BLOCK, PIVOTS
            )
            take = k_limit - count
            kept_mass = mass + take.to(tl.float32) * tie
        if top_p < 1.0:
            limit = top_p * kept_mass
            cut, count, mass, tie, lo = _search_cut(
                row_ptr, V, temperature, lse, k_limit, limit, lo, q_max, BLOCK, PIVOTS
            )
            # Tied tokens j = 0, 1, ... have mass mass + j * tie before them; those below limit are kept.
            by_mass = tl.minimum(tl.ceil((limit - mass) / tl.where(tie > 0.0, tie, 1.0)), V * 1.0)
            by_mass = tl.where(tie > 0.0, by_mass, V * 1.0)
            take = tl.minimum(k_limit - count, tl.where(mass < limit, by_mass, 0.0).to(tl.int32))
        q_floor = tl.load(min_p_ptr + row) * q_max

        # Gumbel-max over the allowed tokens.
        key = tl.load(key_ptr + row).to(tl.uint32)
        ties_seen = tl.full([], 0, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_ok = cols < V
            log_p = _log_probs(row_ptr, cols, col_ok, temperature, lse)
            q = tl.exp(log_p)
            is_tie = ((q == tie) & col_ok).to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(is_tie, axis=0) - is_tie
            ties_seen += tl.sum(is_tie, axis=0)
            in_prefix = (q.to(tl.int32, bitcast=True) >= cut) | ((is_tie > 0) & (tie_rank < take))
            allowed = col_ok & (q >= q_floor) & in_prefix
            g = -tl.log(-tl.log(counter_uniform_tile(key, cols)))
            score = tl.where(allowed, log_p + g, float("-inf"))
            chunk_best = tl.max(score, axis=0)
            chunk_id = tl.min(tl.where(score == chunk_best, cols, V), axis=0)
            best_id = tl.where(chunk_best > best, chunk_id, best_id)
            best = tl.maximum(best, chunk_best)
    else:
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))
            chunk_best = tl.max(x, axis=0)
            chunk_id = tl.min(tl.where(x == chunk_best, cols, V), axis=0)
            best_id = tl.where(chunk_best > best, chunk_id, best_id)
            best = tl.maximum(best, chunk_best)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def row_keys(seeds: Tensor, offsets: Tensor) -> Tensor:
    """The per-row key of ``counter_uniform``: [B] int64 holding uint32 values."""
    seeds = seeds.to(torch.int64)
    seed_key = mix32((seeds & _M32) ^ mix32((seeds >> 32) & _M32))
    return mix32(seed_key ^ (offsets.to(torch.int64) & _M32))


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
    """logits: [B, V] float32; temperature, top_p, min_p: [B] float32; top_k: [B] int32; seeds,
    offsets: [B] int64. Returns [B] int64 token ids (see the interface for the exact semantics)."""
    check_device(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    rows, vocab = logits.shape
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperature.to(torch.float32).contiguous(),
            top_k.to(torch.int32).contiguous(),
            top_p.to(torch.float32).contiguous(),
            min_p.to(torch.float32).contiguous(),
            row_keys(seeds, offsets),
            out,
            vocab,
            logits.stride(0),
            BLOCK=min(512, pow2(vocab)),
            PIVOTS=_PIVOTS,
            num_warps=8,
        )
    return out
