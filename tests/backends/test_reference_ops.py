"""The reference backend against independent formulations of each op's contract (float32, tight tolerances).

Every expected value here is computed without calling the reference code: expanded (non-absorbed) MLA,
per-query and per-token Python loops, complex-number RoPE, ``torch.nn.functional.rms_norm``, a direct
transcription of DeepSeek's gating, and statistical checks of the sampler.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

from deepinfer.backends.reference.attention import mla_decode, mla_prefill
from deepinfer.backends.reference.cache import kv_cache_gather, kv_cache_spec, kv_cache_write
from deepinfer.backends.reference.moe import fused_moe, grouped_gemm, moe_route
from deepinfer.backends.reference.norm import add_rms_norm, rms_norm, silu_and_mul
from deepinfer.backends.reference.rope import rope
from deepinfer.backends.reference.sampling import allowed_tokens, counter_uniform, sample

TOL = {"rtol": 1e-5, "atol": 1e-5}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=g) * scale


def softmax_attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """Plain single-query softmax attention in float64: q [D], keys [S, D], values [S, Dv] -> [Dv]."""
    scores = (keys.double() @ q.double()) * scale
    weights = torch.exp(scores - scores.max())
    return (weights / weights.sum()) @ values.double()


# ----------------------------------------------------------------------------------------- MLA decode


def build_paged_cache(
    g: torch.Generator, seq_lens: list[int], latent: int, rope_dim: int
) -> tuple[tuple[Tensor, ...], Tensor, list[Tensor], list[Tensor]]:
    """A NaN-poisoned paged cache holding random latent/rope rows per request under a shuffled block table.

    Returns (kv_cache, block_table [B, M] int32, latents per request [S_b, L], rope keys per request [S_b, R]).
    """
    spec = kv_cache_spec(latent, rope_dim, torch.float32)
    bs = spec.block_size
    blocks_per_req = [math.ceil(s / bs) for s in seq_lens]
    spare = 3
    num_blocks = sum(blocks_per_req) + spare
    kv_cache = spec.allocate(num_blocks, "cpu")
    for t in kv_cache:
        t.fill_(float("nan"))  # unwritten slots and padding entries must never be read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_req)
    table = torch.empty(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        row = perm[used : used + n] + perm[-spare:] * width  # pad with never-written blocks
        table[b] = torch.tensor(row[:width], dtype=torch.int32)
        used += n

    latents = [randn(g, s, latent) for s in seq_lens]
    ropes = [randn(g, s, rope_dim) for s in seq_lens]
    slots = [table[b, j // bs] * bs + j % bs for b, s in enumerate(seq_lens) for j in range(s)]
    all_c = torch.cat(latents)
    all_r = torch.cat(ropes)
    slot_mapping = torch.stack(slots).long()
    # Write in shuffled order, interleaved with padding tokens (slot -1) carrying garbage.
    pad = 4
    all_c = torch.cat((all_c, torch.full((pad, latent), 1e30)))
    all_r = torch.cat((all_r, torch.full((pad, rope_dim), 1e30)))
    slot_mapping = torch.cat((slot_mapping, torch.full((pad,), -1, dtype=torch.long)))
    order = torch.randperm(slot_mapping.shape[0], generator=g)
    kv_cache_write(all_c[order], all_r[order], kv_cache, slot_mapping[order])
    return kv_cache, table, latents, ropes


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "window"),
    [
        ([1, 1, 1], [1, 17, 40], None),  # plain decode
        ([1, 1, 1], [3, 17, 40], 7),  # plain decode, sliding window
        ([1, 3, 2, 4], [5, 20, 33, 4], None),  # speculative verification, a request of only new tokens
        ([1, 3, 2, 4], [5, 20, 33, 4], 6),  # verification with a sliding window
    ],
)
def test_mla_decode_absorbed_equals_expanded_attention(
    query_lens: list[int], seq_lens: list[int], window: int | None
) -> None:
    """Absorbed MLA over the paged latent cache, followed by W_UV, equals ordinary multi-head attention
    with keys cat(W_UK c_j, r_j) and values W_UV c_j under the documented causal/window visibility."""
    g = gen(1000 + sum(seq_lens) + (window or 0))
    heads, nope, latent, rope_dim, v_dim = 3, 8, 16, 4, 6
    kv_cache, table, latents, ropes = build_paged_cache(g, seq_lens, latent, rope_dim)
    w_uk = randn(g, heads, nope, latent, scale=latent**-0.5)
    w_uv = randn(g, heads, v_dim, latent, scale=latent**-0.5)
    num_tokens = sum(query_lens)
    q_nope = randn(g, num_tokens, heads, nope)
    q_pe = randn(g, num_tokens, heads, rope_dim)
    scale = (nope + rope_dim) ** -0.5
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)

    out_latent = mla_decode(
        torch.einsum("thd,hdl->thl", q_nope, w_uk),
        q_pe,
        kv_cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc,
        max(query_lens),
        scale,
        window,
    )
    assert out_latent.shape == (num_tokens, heads, latent)
    assert out_latent.dtype == torch.float32
    absorbed = torch.einsum("thl,hvl->thv", out_latent, w_uv)

    expected = torch.empty(num_tokens, heads, v_dim, dtype=torch.float64)
    for b, (n_b, s_b) in enumerate(zip(query_lens, seq_lens)):
        for i in range(n_b):
            t = int(query_start_loc[b]) + i
            p = s_b - n_b + i
            first = 0 if window is None else max(0, p - window + 1)
            visible = list(range(first, p + 1))
            c, r = latents[b][visible], ropes[b][visible]
            for h in range(heads):
                keys = torch.cat((c @ w_uk[h].T, r), dim=-1)
                values = c @ w_uv[h].T
                q = torch.cat((q_nope[t, h], q_pe[t, h]))
                expected[t, h] = softmax_attend(q, keys, values, scale)
    assert_close(absorbed, expected.float(), **TOL)


# ----------------------------------------------------------------------------------------- MLA prefill


@pytest.mark.parametrize(
    ("lens", "window"),
    [
        ([(5, 5), (1, 1), (7, 7)], None),  # plain causal prefill (square per request)
        ([(3, 10), (1, 7), (4, 4), (0, 3), (6, 9)], None),  # chunked prefill with cached context
        ([(3, 10), (1, 7), (4, 4), (0, 3), (6, 9)], 3),  # ... and a sliding window
        ([(5, 5), (8, 8)], 2),  # square with a sliding window
    ],
)
def test_mla_prefill_matches_per_query_softmax(lens: list[tuple[int, int]], window: int | None) -> None:
    """Varlen prefill equals a per-query softmax loop with the bottom-right-aligned causal mask, the
    sliding window, and a value width different from the q/k width."""
    g = gen(2000 + len(lens) + (window or 0))
    heads, qk_dim, v_dim = 3, 12, 7
    len_q = [a for a, _ in lens]
    len_k = [b for _, b in lens]
    cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(len_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(g, sum(len_q), heads, qk_dim)
    k = randn(g, sum(len_k), heads, qk_dim)
    v = randn(g, sum(len_k), heads, v_dim)
    scale = 0.37

    out = mla_prefill(q, k, v, cu_q, cu_k, max(len_q), max(len_k), scale, window)
    assert out.shape == (sum(len_q), heads, v_dim)

    expected = torch.empty(sum(len_q), heads, v_dim, dtype=torch.float64)
    for b, (nq, nk) in enumerate(lens):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        for i in range(nq):
            p = nk - nq + i
            visible = [j for j in range(nk) if j <= p and (window is None or j > p - window)]
            rows = [k0 + j for j in visible]
            for h in range(heads):
                expected[q0 + i, h] = softmax_attend(q[q0 + i, h], k[rows, h], v[rows, h], scale)
    assert_close(out, expected.float(), **TOL)


# ----------------------------------------------------------------------------------------- RoPE


def cos_sin_table(positions: int, rope_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """(cache [P, R] = cat(cos, sin), angles [P, R/2]) from inverse frequencies."""
    inv_freq = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float(), angles


def test_rope_interleaved_is_complex_multiplication() -> None:
    """Interleaved RoPE rotates pairs (2i, 2i+1) like multiplying the complex number x_2i + i x_2i+1 by
    exp(i * pos * f_i) (DeepSeek's layout), for the per-head queries and the shared key."""
    g = gen(3000)
    tokens, heads, rope_dim, max_pos = 9, 4, 16, 64
    cache, angles = cos_sin_table(max_pos, rope_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = randn(g, tokens, heads, rope_dim)
    k = randn(g, tokens, rope_dim)

    q_rot, k_rot = rope(q, k, positions, cache, True)

    rot = torch.polar(torch.ones_like(angles[positions]), angles[positions]).to(torch.complex64)  # [T, R/2]

    def expected(x: Tensor, r: Tensor) -> Tensor:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], rope_dim // 2, 2).contiguous())
        return torch.view_as_real(z * r).flatten(-2)

    assert_close(q_rot, expected(q, rot[:, None, :]), **TOL)
    assert_close(k_rot, expected(k, rot), **TOL)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


def test_rope_rotate_half_layout() -> None:
    """Non-interleaved RoPE equals x * cos + rotate_half(x) * sin with pairs (i, i + R/2)."""
    g = gen(3001)
    tokens, heads, rope_dim, max_pos = 7, 2, 8, 32
    cache, angles = cos_sin_table(max_pos, rope_dim, base=500.0)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = randn(g, tokens, heads, rope_dim)
    k = randn(g, tokens, rope_dim)

    q_rot, k_rot = rope(q, k, positions, cache, False)

    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[positions].float()
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[positions].float()

    def rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x[..., : rope_dim // 2], x[..., rope_dim // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    assert_close(q_rot, q * cos[:, None] + rotate_half(q) * sin[:, None], **TOL)
    assert_close(k_rot, k * cos + rotate_half(k) * sin, **TOL)


# ----------------------------------------------------------------------------------------- norms


def test_rms_norm_matches_torch() -> None:
    """rms_norm equals torch.nn.functional.rms_norm over the last dimension, for any leading shape."""
    g = gen(4000)
    x = randn(g, 3, 5, 32, scale=3.0)
    weight = randn(g, 32)
    assert_close(rms_norm(x, weight, 1e-6), F.rms_norm(x, (32,), weight, 1e-6), **TOL)
    assert_close(rms_norm(x, weight, 0.5), F.rms_norm(x, (32,), weight, 0.5), **TOL)


def test_add_rms_norm_returns_norm_of_sum_and_sum() -> None:
    """add_rms_norm returns (rms_norm(x + residual), x + residual) and leaves its inputs untouched."""
    g = gen(4001)
    x, residual, weight = randn(g, 6, 48), randn(g, 6, 48), randn(g, 48)
    x0, r0 = x.clone(), residual.clone()
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert_close(summed, x0 + r0, rtol=0, atol=0)
    assert_close(normed, F.rms_norm(x0 + r0, (48,), weight, 1e-5), **TOL)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_silu_and_mul() -> None:
    """silu_and_mul on [..., 2I] holding [gate | up] returns silu(gate) * up."""
    g = gen(4002)
    x = randn(g, 2, 5, 2 * 24)
    gate, up = x[..., :24], x[..., 24:]
    assert_close(silu_and_mul(x), F.silu(gate) * up, **TOL)


# ----------------------------------------------------------------------------------------- routing


def published_gate(
    logits: list[float],
    bias: list[float] | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring: str,
    method: str,
    renormalize: bool,
    scaling: float,
) -> dict[int, float]:
    """One token's routing, transcribed from DeepSeek's published gates: {expert id: weight}."""
    num_experts = len(logits)
    if scoring == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-x)) for x in logits]
    else:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        scores = [e / sum(exps) for e in exps]
    choice = [s + b for s, b in zip(scores, bias)] if method == "noaux_tc" else scores
    candidates = list(range(num_experts))
    if method != "greedy":
        size = num_experts // n_group
        groups = [choice[i * size : (i + 1) * size] for i in range(n_group)]
        if method == "noaux_tc":
            group_score = [sum(sorted(grp, reverse=True)[:2]) for grp in groups]
        else:
            group_score = [max(grp) for grp in groups]
        kept = sorted(range(n_group), key=lambda i: -group_score[i])[:topk_group]
        candidates = [e for e in candidates if e // size in kept]
    chosen = sorted(candidates, key=lambda e: -choice[e])[:top_k]
    weights = [scores[e] for e in chosen]
    if renormalize:
        total = sum(weights) + 1e-20
        weights = [w / total for w in weights]
    return {e: w * scaling for e, w in zip(chosen, weights)}


@pytest.mark.parametrize(
    ("experts", "top_k", "n_group", "topk_group", "scoring", "method", "renormalize", "scaling"),
    [
        (32, 6, 8, 3, "sigmoid", "noaux_tc", True, 2.5),  # V3 layout (scaled down)
        (32, 6, 8, 3, "sigmoid", "noaux_tc", False, 1.0),
        (16, 4, 4, 4, "sigmoid", "noaux_tc", True, 1.5),  # every group kept
        (16, 4, 1, 1, "softmax", "greedy", False, 16.0),  # V2-Lite
        (16, 4, 1, 1, "softmax", "greedy", True, 1.0),
        (24, 4, 4, 2, "softmax", "group_limited_greedy", False, 2.0),  # V2
    ],
)
def test_moe_route_matches_published_gating(
    experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring: str,
    method: str,
    renormalize: bool,
    scaling: float,
) -> None:
    """moe_route picks the same expert set per token, with the same weights, as a per-token transcription
    of DeepSeek-V3 (noaux_tc: biased selection, top-2-sum group score, unbiased weights) and V2 gating."""
    g = gen(5000 + experts + top_k + n_group)
    tokens = 40
    logits = randn(g, tokens, experts, scale=2.0)
    bias = randn(g, experts, scale=0.3) if method == "noaux_tc" else None  # negative entries included

    weights, ids = moe_route(logits, bias, top_k, n_group, topk_group, scoring, method, renormalize, scaling)
    assert weights.shape == ids.shape == (tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32

    bias_list = bias.tolist() if bias is not None else None
    differs_from_unbiased = 0
    for t in range(tokens):
        row = logits[t].tolist()
        want = published_gate(
            row, bias_list, top_k, n_group, topk_group, scoring, method, renormalize, scaling
        )
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert sorted(got) == sorted(want), f"token {t}: experts {sorted(got)} != {sorted(want)}"
        assert_close(
            torch.tensor([got[e] for e in sorted(want)]), torch.tensor([want[e] for e in sorted(want)]), **TOL
        )
        if method == "noaux_tc":
            unbiased = published_gate(
                row, [0.0] * experts, top_k, n_group, topk_group, scoring, method, False, 1
            )
            differs_from_unbiased += sorted(unbiased) != sorted(want)
    if method == "noaux_tc":
        assert differs_from_unbiased > 0, "the correction bias never changed a selection: weak test data"


# ----------------------------------------------------------------------------------------- expert GEMMs


@pytest.mark.parametrize("group_sizes", [[3, 0, 4, 0, 2], [0, 5, 0, 0, 1, 0], [0, 0, 0]])
def test_grouped_gemm_matches_per_row_matmul(group_sizes: list[int]) -> None:
    """Row r of the output is weight[e(r)] @ x[r], experts with zero rows included."""
    g = gen(6000 + len(group_sizes))
    experts, k_dim, n_out = len(group_sizes), 10, 6
    n = sum(group_sizes)
    x = randn(g, n, k_dim)
    weight = randn(g, experts, n_out, k_dim)
    sizes = torch.tensor(group_sizes, dtype=torch.int64)

    out = grouped_gemm(x, weight, sizes)

    expert_of_row = torch.repeat_interleave(torch.arange(experts), sizes)
    expected = torch.bmm(weight[expert_of_row], x[:, :, None]).squeeze(-1)
    assert out.shape == (n, n_out)
    assert_close(out, expected, **TOL)


def test_fused_moe_matches_per_token_loop() -> None:
    """fused_moe equals a per-token loop over its k experts (gate/up halves of w13, silu(gate) * up, w2,
    weighted sum); negative ids contribute nothing, a token with only negative ids gets zeros, and
    experts that receive no token are harmless."""
    g = gen(7000)
    tokens, hidden_dim, inter, experts, top_k = 9, 16, 12, 8, 3
    hidden = randn(g, tokens, hidden_dim)
    w13 = randn(g, experts, 2 * inter, hidden_dim, scale=hidden_dim**-0.5)
    w2 = randn(g, experts, hidden_dim, inter, scale=inter**-0.5)
    ids = torch.stack(
        [torch.randperm(experts - 2, generator=g)[:top_k] for _ in range(tokens)]
    )  # 6, 7 unused
    ids[torch.rand(ids.shape, generator=g) < 0.3] = -1
    ids[4] = -1
    weights = torch.rand(tokens, top_k, generator=g) + 0.1

    out = fused_moe(hidden, w13, w2, weights, ids.to(torch.int32))

    expected = torch.zeros(tokens, hidden_dim)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate = w13[e, :inter] @ hidden[t]
            up = w13[e, inter:] @ hidden[t]
            expected[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    assert_close(out, expected, **TOL)
    assert torch.equal(out[4], torch.zeros(hidden_dim))
    assert_close(fused_moe(hidden, w13, w2, weights, ids), out, rtol=0, atol=0)  # int64 ids too


# ----------------------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_gather_round_trip(dtype: torch.dtype) -> None:
    """Written rows read back in slot order (cast to the cache dtype); padding slots (-1) are skipped and
    every slot not written keeps its previous contents; later writes overwrite earlier ones."""
    g = gen(8000)
    latent, rope_dim, num_blocks = 12, 4, 5
    spec = kv_cache_spec(latent, rope_dim, dtype)
    kv_cache = spec.allocate(num_blocks, "cpu")
    for t in kv_cache:
        t.fill_(-7.0)
    total = num_blocks * spec.block_size
    tokens = 23
    slots = torch.randperm(total, generator=g)[:tokens]
    slots[[3, 11, 17]] = -1
    kv_c, k_pe = randn(g, tokens, latent), randn(g, tokens, rope_dim)

    kv_cache_write(kv_c, k_pe, kv_cache, slots)

    valid = slots >= 0
    got_c, got_pe = kv_cache_gather(kv_cache, slots[valid], latent)
    assert got_c.dtype == got_pe.dtype == dtype
    assert torch.equal(got_c, kv_c[valid].to(dtype)) and torch.equal(got_pe, k_pe[valid].to(dtype))
    untouched = torch.tensor(sorted(set(range(total)) - set(slots[valid].tolist())))
    rest_c, rest_pe = kv_cache_gather(kv_cache, untouched, latent)
    assert bool((rest_c == -7.0).all()) and bool((rest_pe == -7.0).all())

    again = slots[valid][:5]
    new_c, new_pe = randn(g, 5, latent), randn(g, 5, rope_dim)
    kv_cache_write(new_c, new_pe, kv_cache, again)
    got_c, got_pe = kv_cache_gather(kv_cache, again.flip(0), latent)
    assert torch.equal(got_c, new_c.flip(0).to(dtype)) and torch.equal(got_pe, new_pe.flip(0).to(dtype))


# ----------------------------------------------------------------------------------------- sampling


def sample_rows(
    logits: Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    offsets: Tensor | None = None,
) -> Tensor:
    """Sample every row of ``logits`` with one set of parameters (offsets default to 0..B-1)."""
    rows = logits.shape[0]
    return sample(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.int32),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
        torch.full((rows,), seed, dtype=torch.int64),
        torch.arange(rows, dtype=torch.int64) if offsets is None else offsets,
    )


def allowed_set(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The documented filters, written out: top-k, then the top-p nucleus of the renormalised top-k
    distribution (ties by lower id), intersected with p >= min_p * max(p)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if top_k > 0:
        order = order[:top_k]
    mass = sum(probs[i] for i in order)
    nucleus: list[int] = []
    acc = 0.0
    for i in order:
        nucleus.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    return {i for i in nucleus if probs[i] >= min_p * max(probs)}


def chi_square(counts: Tensor, probs: Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


# 99.9% quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def test_greedy_when_temperature_is_zero() -> None:
    """Temperature 0 returns argmax(logits) whatever the filters, seeds and offsets say."""
    g = gen(9000)
    logits = randn(g, 6, 50, scale=3.0)
    out = sample(
        logits,
        torch.zeros(6),
        torch.tensor([0, 1, 5, 0, 3, 50], dtype=torch.int32),
        torch.tensor([1.0, 0.1, 0.5, 0.9, 1.0, 0.01]),
        torch.tensor([0.0, 0.0, 0.9, 0.5, 0.0, 0.2]),
        torch.randint(-(2**62), 2**62, (6,), generator=g),
        torch.randint(0, 1000, (6,), generator=g),
    )
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_one_is_argmax(temperature: float) -> None:
    """top_k = 1 leaves only the most probable token, at any temperature and any (seed, offset)."""
    g = gen(9001)
    logits = randn(g, 64, 30)
    assert torch.equal(sample_rows(logits, temperature, top_k=1, seed=1234), logits.argmax(dim=-1))


def test_same_seed_and_offset_same_token_and_offsets_vary() -> None:
    """The draw is a pure function of (logits, seed, offset): repeating it repeats the token, while
    changing the offset or the seed changes the draws."""
    logits = torch.zeros(256, 8)  # uniform over 8 tokens
    first = sample_rows(logits, 1.0, seed=42)
    assert torch.equal(first, sample_rows(logits, 1.0, seed=42))
    assert len(set(first.tolist())) == 8, "offsets 0..255 should reach every one of 8 uniform tokens"
    other_seed = sample_rows(logits, 1.0, seed=43)
    assert (first != other_seed).float().mean() > 0.6
    same_offset = sample_rows(logits, 1.0, seed=42, offsets=torch.full((256,), 7))
    assert len(set(same_offset.tolist())) == 1


def test_sample_is_batch_invariant() -> None:
    """A row's token depends only on its own logits and parameters: adding, removing or reordering
    other rows (greedy or filtered ones included) never changes it."""
    g = gen(9002)
    rows, vocab = 10, 64
    logits = randn(g, rows, vocab, scale=2.0)
    params = (
        torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 2.0, 0.5, 1.0, 0.9, 1.1]),
        torch.tensor([0, 0, 0, 10, 0, 5, 0, 20, 1, 0], dtype=torch.int32),
        torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 0.8, 0.95, 1.0, 1.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.2]),
        torch.randint(-(2**62), 2**62, (rows,), generator=g),
        torch.randint(0, 5000, (rows,), generator=g),
    )
    full = sample(logits, *params)

    perm = torch.randperm(rows, generator=g)
    assert torch.equal(sample(logits[perm], *(p[perm] for p in params)), full[perm])
    for i in range(rows):
        assert int(sample(logits[i : i + 1], *(p[i : i + 1] for p in params))) == int(full[i])
    subset = torch.tensor([0, 3, 4, 9])
    assert torch.equal(sample(logits[subset], *(p[subset] for p in params)), full[subset])
    doubled = sample(torch.cat((logits, logits)), *(torch.cat((p, p)) for p in params))
    assert torch.equal(doubled, torch.cat((full, full)))


FILTERS = [
    {"top_k": 5},
    {"top_p": 0.7},
    {"min_p": 0.2},
    {"top_k": 8, "top_p": 0.8, "min_p": 0.35},
    {"top_k": 3, "top_p": 0.5},
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filters_never_draw_disallowed_tokens(filters: dict[str, float]) -> None:
    """Over many offsets, every drawn token lies in the top-k / top-p nucleus / min-p set computed
    independently from the documented rules, and every allowed token is drawn at some offset."""
    g = gen(9003)
    vocab, draws, temperature = 16, 3000, 1.2
    ranks = torch.randperm(vocab, generator=g)  # token ids in no particular probability order
    logits = (-0.35 * ranks.float())[None, :].expand(draws, vocab)
    probs = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    allowed = allowed_set(
        probs, filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0)
    )
    assert 1 < len(allowed) < vocab

    out = sample_rows(logits, temperature, seed=77, **filters)
    drawn = set(out.tolist())
    assert drawn <= allowed, f"drew disallowed tokens {sorted(drawn - allowed)}"
    assert drawn == allowed


@pytest.mark.parametrize(
    ("temperature", "filters"),
    [(1.0, {}), (0.8, {}), (1.5, {"top_k": 5}), (1.0, {"top_k": 7, "top_p": 0.9, "min_p": 0.12})],
)
def test_empirical_frequencies_follow_softmax(temperature: float, filters: dict[str, float]) -> None:
    """20k draws (varying offsets, fixed seed) on an 8-token vocabulary follow softmax(logits / T),
    renormalised over the allowed tokens, within a chi-square test at the 99.9% level."""
    g = gen(9004)
    vocab, draws = 8, 20000
    logits = randn(g, vocab)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    allowed = allowed_set(
        probs.tolist(), filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0)
    )
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(allowed)] = True
    target = torch.where(mask, probs, 0.0)
    target = target / target.sum()

    out = sample_rows(logits[None, :].expand(draws, vocab), temperature, seed=2024, **filters)
    counts = torch.bincount(out, minlength=vocab)
    assert int(counts[~mask].sum()) == 0
    stat = chi_square(counts[mask], target[mask])
    assert stat < CHI2_999[len(allowed) - 1], f"chi-square {stat:.1f} with {len(allowed) - 1} dof"


def test_counter_uniform_range_moments_and_independence() -> None:
    """counter_uniform is float32 in (0, 1) with mean ~1/2 and variance ~1/12, and changes with the seed
    (low and high 32 bits), the offset and the token id."""
    g = gen(9005)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=g)
    offsets = torch.randint(0, 2**40, (64,), generator=g)
    u = counter_uniform(seeds, offsets, 16384)
    assert u.shape == (64, 16384) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.double().mean()) - 0.5) < 2e-3
    assert abs(float(u.double().var()) - 1 / 12) < 2e-3

    base_seed, base_offset = 123456789, 17
    variants = counter_uniform(
        torch.tensor([base_seed, base_seed + 1, base_seed + 2**32, -base_seed, base_seed, base_seed]),
        torch.tensor(
            [base_offset, base_offset, base_offset, base_offset, base_offset + 1, base_offset + 2**20]
        ),
        4096,
    )
    for i in range(1, variants.shape[0]):
        assert (variants[0] == variants[i]).float().mean() < 0.01, f"variant {i} repeats the base noise"
    assert len(set(variants[0].tolist())) > 4000, "noise barely depends on the token id"
    assert torch.equal(
        counter_uniform(torch.tensor([base_seed]), torch.tensor([base_offset]), 4096)[0], variants[0]
    )


def test_counter_uniform_extreme_draw_stays_below_one() -> None:
    """At (seed 0, offset 243, token 58771) the hash takes its largest 24-bit value; u must still be < 1
    (u == 1 gives infinite Gumbel noise), and u * 2**24 is an odd integer (exact in float32)."""
    u = counter_uniform(torch.tensor([0]), torch.tensor([243]), 58772)[0]
    assert float(u[58771]) < 1.0
    assert float(u.max()) == float(u[58771])
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round()) and bool((scaled.long() % 2 == 1).all())


def test_negligible_token_is_not_drawn_at_extreme_noise() -> None:
    """A token with probability ~e^-40 is not drawn even where the generator gives it its largest value."""
    vocab = 58772
    logits = torch.full((1, vocab), -40.0)
    logits[0, 0] = 0.0
    out = sample_rows(logits, 1.0, seed=0, offsets=torch.tensor([243]))
    assert int(out[0]) == 0


def test_top_p_one_is_off_even_when_the_tail_rounds_away() -> None:
    """top_p = 1 disables the nucleus filter: tokens whose mass is lost to float32 rounding stay allowed,
    alone or next to rows that do filter (batch invariance of the allowed set)."""
    logits = torch.tensor([[0.0, -17.5, -17.5, -17.5]] * 3)
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([0, 2, 1], dtype=torch.int32)
    mask = allowed_tokens(probs, top_k, torch.ones(3), torch.zeros(3))
    assert mask[0].tolist() == [True] * 4
    assert mask[1].tolist() == [True, True, False, False]
    assert mask[2].tolist() == [True, False, False, False]
    alone = allowed_tokens(probs[:1], top_k[:1], torch.ones(1), torch.zeros(1))
    assert torch.equal(alone[0], mask[0])
