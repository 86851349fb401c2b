"""The op interface: every accelerator op the engine calls, with its contract.

Each function here states shapes, dtypes, layouts and in-place effects, and dispatches to the active
backend's implementation (``deepinfer.backends.registry.active_ops()``). Backends implement functions
with the same names and parameters (the registry checks the signatures); the reference backend
(``deepinfer.backends.reference``) is the numerical oracle the conformance suite compares against.

Batch invariance (deterministic mode, ``activate(..., deterministic=True)``): every op's result for
one row (a token; for attention, a query token of its request) must be bit-for-bit the same whatever
other rows share the call, how many there are, and where the row sits among them; the attention ops
must also give a query token the same bits whether its request's other query tokens are computed in
the same call or not. Each backend declares, per op, how it meets this (``registry.OpTable``), and the
conformance suite checks it (``deepinfer.backends.testing.invariance``).

Notation: ``T`` tokens in the step (packed, variable-length), ``B`` requests, ``H`` query heads,
``L`` = kv_lora_rank (latent width), ``R`` = qk_rope_head_dim, ``Dn`` = qk_nope_head_dim,
``Dv`` = v_head_dim, ``E`` experts, ``k`` experts per token, ``V`` vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from deepinfer.backends.cache_spec import KVCacheSpec
from deepinfer.backends.quant import WeightFormat
from deepinfer.backends.registry import active_ops, portable

ScoringFunc = Literal["sigmoid", "softmax"]
TopkMethod = Literal["noaux_tc", "greedy", "group_limited_greedy"]


@dataclass(slots=True)
class EPDispatch:
    """What ``ep_dispatch`` delivers to this rank, and what ``ep_combine`` needs to send it back.

    ``hidden`` [N, D], ``local_expert_ids`` [N] int32 (index among this rank's experts) and ``weights``
    [N] float32 are the (token, expert) pairs routed to this rank; ``handle`` is backend-private state
    (split sizes, original order) that only the same backend's ``ep_combine`` reads.
    """

    hidden: Tensor
    local_expert_ids: Tensor
    weights: Tensor
    handle: Any


# ----------------------------------------------------------------------------------------- dense


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Dense projection (every nn.Linear of the model, the router and the LM head).

    x: [T, K] with weight [N, K] (nn.Linear layout) -> ``x @ weight.T (+ bias [N])``: [T, N]; or, one
    matrix per head, x: [T, H, K] with weight [H, N, K] -> [T, H, N] (``out[:, h] = x[:, h] @
    weight[h].T``; MLA's absorbed W_UK / W_UV; bias must be None). Accumulates in at least x's
    precision; returns a new tensor in x's dtype (x and weight share a dtype).
    """
    return active_ops().linear(x, weight, bias)


# ----------------------------------------------------------------------------------------- small ops


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    x: [..., D] (fp32/bf16/fp16); weight: [D]. Statistics are computed in float32. Returns a new
    tensor of x's shape and dtype.
    """
    return active_ops().rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Fused residual add + RMSNorm: ``s = x + residual``; returns ``(rms_norm(s), s)``.

    x, residual: [T, D] same dtype; weight: [D]. The sum is formed in x's dtype (as an unfused
    ``x + residual`` would be). Returns two new tensors (inputs are not modified).
    """
    return active_ops().add_rms_norm(x, residual, weight, eps)


def rope(
    q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of the rope part of MLA queries and the shared rope key.

    q: [T, H, R]; k: [T, R]; positions: [T] int64; cos_sin_cache: [P, R] float32 whose row ``p`` is
    ``cat(cos(p * f), sin(p * f))`` for the R/2 frequencies ``f`` (any YaRN scaling and attention
    factor already folded in). ``interleaved=True`` pairs dims ``(2i, 2i+1)`` (DeepSeek's layout);
    ``False`` pairs ``(i, i + R/2)`` (rotate-half). Each pair is rotated by its frequency and written
    back to the same two dims. Returns new tensors ``(q_rot, k_rot)`` with the input dtypes.
    """
    return active_ops().rope(q, k, positions, cos_sin_cache, interleaved)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU activation: x: [..., 2I] holding ``[gate | up]``; returns ``silu(gate) * up``: [..., I]."""
    return active_ops().silu_and_mul(x)


# ----------------------------------------------------------------------------------------- KV cache


def kv_cache_spec(kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    """The backend's paged cache layout for one MLA layer holding, per token, the normalised latent
    (``kv_lora_rank`` wide) and the rotated rope key (``qk_rope_head_dim`` wide)."""
    return active_ops().kv_cache_spec(kv_lora_rank, qk_rope_head_dim, dtype)


def kv_cache_write(kv_c: Tensor, k_pe: Tensor, kv_cache: Sequence[Tensor], slot_mapping: Tensor) -> None:
    """Scatter new latent and rope rows into the paged cache, in place.

    kv_c: [T, L]; k_pe: [T, R] (already rotated); kv_cache: this layer's tensors as allocated from
    ``kv_cache_spec``; slot_mapping: [T] int64, ``slot = block_id * block_size + offset``. Tokens with a
    negative slot (padding) are skipped. Values are cast to the cache dtype.
    """
    active_ops().kv_cache_write(kv_c, k_pe, kv_cache, slot_mapping)


def kv_cache_gather(
    kv_cache: Sequence[Tensor], slot_mapping: Tensor, kv_lora_rank: int
) -> tuple[Tensor, Tensor]:
    """Read latent and rope rows back from the paged cache.

    slot_mapping: [N] int64 of valid slots; kv_lora_rank: L. Returns ``(kv_c [N, L], k_pe [N, R])`` in
    the cache dtype, in slot_mapping order. Used by expanded (prefill) attention over cached context.
    """
    return active_ops().kv_cache_gather(kv_cache, slot_mapping, kv_lora_rank)


# ----------------------------------------------------------------------------------------- attention


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
    """Variable-length causal attention in expanded MLA form (prefill and chunked prefill).

    q: [Tq, H, Dn + R]; k: [Tk, H, Dn + R]; v: [Tk, H, Dv] (Dv may differ from the q/k width);
    cu_seqlens_q / cu_seqlens_k: [B+1] int32 prefix sums of per-request query / key lengths. Each
    request's queries are the LAST ``len_q`` of its ``len_k`` keys (``len_k >= len_q``; the rest is
    cached context), so query ``i`` sits at position ``p = len_k - len_q + i`` and attends keys
    ``j <= p`` (bottom-right-aligned causal mask), and with ``sliding_window = W`` only keys
    ``j > p - W``. Softmax in float32 with ``scale`` applied to q·k (callers must pass it; there is no
    default). Returns a new tensor [Tq, H, Dv] in q's dtype.
    """
    return active_ops().mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sliding_window
    )


@portable
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
    """Expanded MLA attention of prefill queries over ONE PIECE of their keys, with the log-sum-exp
    that merges pieces (a chunk over a long cached context is computed tile by tile, so its workspace
    does not grow with the context).

    Shapes as ``mla_prefill``: q [Tq, H, Dn + R], k [Tk, H, Dn + R], v [Tk, H, Dv], cu_seqlens_q /
    cu_seqlens_k [B+1] int32. ``causal=True``: the keys end at the queries, masked as ``mla_prefill``
    without a window (query ``i`` of ``len_q`` attends keys ``j <= len_k - len_q + i``; ``len_k >=
    len_q``). ``causal=False``: the keys all precede the queries, and every query attends every key of
    its request; a request may have no keys (``len_k = 0``). Softmax in float32 with ``scale``.
    Returns new float32 tensors ``(out [Tq, H, Dv], lse [Tq, H])`` with ``lse = log(sum_j exp(scale *
    q.k_j))`` over the attended keys; a query with no keys gets ``out = 0`` and ``lse = -inf``.
    """
    return active_ops().mla_prefill_partial(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal
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
    """Absorbed MLA attention over the paged latent cache (decode and speculative verification).

    Multi-query attention with one shared KV "head": the key of cached token ``j`` is
    ``cat(latent_j, rope_j)`` (L + R wide) and its value is ``latent_j`` (L wide).
    q_nope: [T, H, L] (the nope query already multiplied by W_UK); q_pe: [T, H, R] (rotated);
    kv_cache: this layer's tensors, already holding the new tokens' rows; block_table: [B, M] int32
    physical block ids per request (M may exceed the longest request's blocks: columns past a
    request's blocks hold arbitrary ids and are never read); seq_lens: [B] int32 total tokens per
    request INCLUDING its new query tokens; query_start_loc: [B+1] int32 prefix sums of query tokens per request (1 for plain
    decode, 1 + drafts for verification); max_query_len: the largest per-request query count.
    Query ``i`` of request ``b`` (``n_b`` queries) sits at position ``p = seq_lens[b] - n_b + i`` and
    attends cached positions ``j <= p`` (and ``j > p - W`` with ``sliding_window = W``). Softmax in
    float32 with ``scale``. Returns a new tensor [T, H, L] in q_nope's dtype (multiply by W_UV next).
    """
    return active_ops().mla_decode(
        q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale, sliding_window
    )


# ----------------------------------------------------------------------------------------- MoE


def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: ScoringFunc,
    topk_method: TopkMethod,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek expert routing.

    router_logits: [T, E] float32. ``scores = sigmoid(logits)`` or ``softmax(logits)``.
    - ``noaux_tc`` (V3): selection uses ``scores + correction_bias`` ([E] float32); groups (E / n_group
      experts each) are ranked by the sum of their two best biased scores, the best ``topk_group``
      groups are kept, and the top ``top_k`` experts among them are chosen. The returned weights are
      the UNBIASED scores of the chosen experts.
    - ``greedy`` (V2): top ``top_k`` of the scores.
    - ``group_limited_greedy`` (V2): groups ranked by their best score, ``topk_group`` kept, then top-k.
    If ``renormalize``, weights are divided by their sum (+1e-20); then all are multiplied by
    ``routed_scaling_factor``. Returns ``(weights [T, k] float32, expert_ids [T, k] int32)``; the order
    of the k entries is unspecified (consumers must not depend on it).
    """
    return active_ops().moe_route(
        router_logits,
        correction_bias,
        top_k,
        n_group,
        topk_group,
        scoring_func,
        topk_method,
        renormalize,
        routed_scaling_factor,
    )


def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """Per-expert matrix multiply over rows grouped by expert.

    x: [N, K] with rows sorted so that the first ``group_sizes[0]`` rows belong to expert 0, the next
    ``group_sizes[1]`` to expert 1, and so on; weight: [E, Nout, K] (nn.Linear layout per expert);
    group_sizes: [E] int64 summing to N. Returns [N, Nout] in x's dtype: ``out[r] = weight[e(r)] @ x[r]``.
    """
    return active_ops().grouped_gemm(x, weight, group_sizes)


def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Routed-expert MLP with weighted combine.

    hidden: [T, D]; w13: [E, 2I, D] (gate rows then up rows, as transformers' ``gate_up_proj``);
    w2: [E, D, I]; topk_weights: [T, k] float32; topk_ids: [T, k] int32/int64, ids in ``[0, E)``; a
    negative id (an expert owned by another rank) contributes nothing. Returns [T, D] in hidden's dtype:
    ``out[t] = sum_j w[t, j] * (w2[e] @ silu_and_mul(w13[e] @ hidden[t]))`` with ``e = topk_ids[t, j]``,
    accumulated in float32.
    """
    return active_ops().fused_moe(hidden, w13, w2, topk_weights, topk_ids)


def ep_dispatch(
    hidden: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    group: Any | None,
) -> EPDispatch:
    """Expert-parallel all-to-all dispatch over ``group`` (a torch.distributed process group).

    Experts are placed contiguously: rank ``r`` of ``W`` owns experts ``[r * E/W, (r+1) * E/W)``.
    hidden: [T, D]; topk_ids: [T, k] global expert ids; topk_weights: [T, k] float32. Every (token, j)
    pair is sent to the rank owning its expert. With ``group`` None or a world size of 1 nothing is
    communicated. Collective: every rank of the group must call it.
    """
    return active_ops().ep_dispatch(hidden, topk_ids, topk_weights, num_experts, group)


def ep_combine(expert_out: Tensor, dispatch: EPDispatch, group: Any | None) -> Tensor:
    """Inverse of ``ep_dispatch``: expert_out [N, D] holds this rank's expert outputs for the pairs it
    received (same order as ``dispatch.hidden``); they are sent back and combined per token as
    ``sum_j weight[t, j] * out[t, j]`` (float32 accumulation). Returns [T, D] in expert_out's dtype.
    Collective."""
    return active_ops().ep_combine(expert_out, dispatch, group)


# ----------------------------------------------------------------------------------------- quantised weights
# Weights kept as stored: (values, scale) pairs in a ``WeightFormat`` (deepinfer.backends.quant states
# each layout exactly). Every op below is defined as "dequantise with ``quant.dequantize``, then the
# high-precision op"; a backend converts per tile instead, with float32 accumulation, and must match
# that definition within the conformance tolerance. They are portable: a backend without its own
# kernel runs the reference (dequantise, then matmul), which the activation log names.


@portable
def quant_fp8_group(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    """Per-token-group FP8 activation quantisation (DeepSeek's ``act_quant``).

    x: [M, K] float -> (values [M, K] float8_e4m3fn, scale [M, ceil(K / group)] float32) with
    ``x ≈ values * scale`` per group of ``group`` columns (the last group may be partial). scale =
    max(group amax, 1e-4) / 448, rounded up to a power of two when ``ue8m0`` (V3.1 and later). Exactly
    ``quant.quantize_activations_fp8``: a row's result never depends on the other rows.
    """
    return active_ops().quant_fp8_group(x, group, ue8m0)


@portable
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    """W8A16 block-scaled projection: activations stay in their dtype, weights are FP8.

    x: [T, K] (float32, bfloat16 or float16); weight: [N, K] float8_e4m3fn; weight_scale:
    [ceil(N / bn), ceil(K / bk)] float32 for ``block = (bn, bk)``; bias: [N] or None. Returns [T, N] in
    x's dtype: ``x @ dequantize(weight, weight_scale).T (+ bias)``, accumulated in float32 (each K
    block's partial product scaled by its own block scale). N and K need not be multiples of the block.
    """
    return active_ops().fp8_linear(x, weight, weight_scale, block, bias)


@portable
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """W8A8 block-scaled projection, for hardware that multiplies FP8 (the model quantises x first with
    ``quant_fp8_group(x, block[1], ...)``).

    x_values: [T, K] float8_e4m3fn with x_scale [T, ceil(K / bk)] float32; weight / weight_scale as in
    ``fp8_linear``. Returns [T, N] in ``out_dtype``: ``(x_values * x_scale) @ dequantize(weight).T (+
    bias)``, float32 accumulation with both scales applied per K block inside the K loop.
    """
    return active_ops().fp8_linear_w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype)


@portable
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    """``grouped_gemm`` with quantised expert weights (W8A16 / W4A16).

    x: [N, K] rows sorted by expert as in ``grouped_gemm``; weight: [E, Nout, K] float8_e4m3fn or, for
    ``fmt.kind == "mxfp4"``, [E, Nout, K / 2] uint8; weight_scale: [E, *fmt.scale_shape(Nout, K)];
    group_sizes: [E] int64. Returns [N, Nout] in x's dtype:
    ``out[r] = dequantize(weight[e(r)], weight_scale[e(r)]) @ x[r]``, float32 accumulation.
    """
    return active_ops().grouped_gemm_quant(x, weight, weight_scale, fmt, group_sizes)


@portable
def fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    """``fused_moe`` with quantised expert weights (FP8 block-scaled or MXFP4, ``fmt``).

    hidden: [T, D]; w13: [E, 2I, D] values (``[E, 2I, D / 2]`` uint8 for mxfp4) with w13_scale
    [E, *fmt.scale_shape(2I, D)]; w2: [E, D, I] values with w2_scale [E, *fmt.scale_shape(D, I)];
    topk_weights / topk_ids as in ``fused_moe`` (negative ids contribute nothing). Returns [T, D] in
    hidden's dtype, equal to ``fused_moe`` on the dequantised weights (float32 accumulation).
    """
    return active_ops().fused_moe_quant(hidden, w13, w13_scale, w2, w2_scale, fmt, topk_weights, topk_ids)


# ----------------------------------------------------------------------------------------- sampling


# Below this, sampling is greedy: logits / T stays finite for |logits| < 3e33, and at such a temperature
# a logit gap of 1e-3 already weighs e^100 (vLLM draws its greedy line at the same 1e-5).
MIN_SAMPLING_TEMPERATURE = 1e-5


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
) -> Tensor:
    """Sample one token per row, deterministically from (seed, offset).

    logits: [B, V] float32 (penalties and constraints already applied); temperature: [B] float32
    (0 = greedy argmax, ignoring the filters); top_k: [B] int32 (0 = off); top_p: [B] float32 (1 =
    off); min_p: [B] float32 (0 = off); seeds: [B] int64; offsets: [B] int64 (index of the token being
    sampled within its request). With ``probs = softmax(logits / temperature)`` a token is allowed when
    it is among the top_k most probable, within the top_p nucleus of the top-k renormalised
    distribution (the smallest prefix, in descending probability with ties broken by lower id, whose
    mass reaches top_p), and has ``p >= min_p * max(p)``. Among allowed tokens the result is
    ``argmax(log p + g)`` with Gumbel noise ``g = -log(-log(u))`` and ``u = counter_uniform(seed,
    offset, token)`` (``deepinfer.backends.reference.sampling.counter_uniform`` defines the generator
    bit-exactly, so every backend draws the same tokens). Returns [B] int64.

    Values too small for float32 arithmetic are normalised here, before dispatch, so backends see
    temperature 0 or >= ``MIN_SAMPLING_TEMPERATURE`` and top_p >= 0.5 / V: a lower temperature (1e-40
    is a float32 subnormal; ``logits / T`` overflows and the softmax is NaN) is greedy, and top_p is
    raised to 0.5 / V (1e-300 is 0 in float32, which would keep no token), which changes nothing,
    since the most probable token alone has probability >= 1 / V and any smaller nucleus is it alone.
    """
    temperature = torch.where(temperature < MIN_SAMPLING_TEMPERATURE, 0.0, temperature)
    top_p = top_p.clamp_min(0.5 / logits.shape[1])
    return active_ops().sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)


@portable
def greedy(logits: Tensor) -> Tensor:
    """Greedy decoding: each row's most probable token, as ``sample`` picks it at temperature 0.

    logits: [B, V] float32. Returns [B] int64: per row the index of its largest value, the lowest such
    index among ties, and the first NaN's index in a row that holds one (NaN ranks above every number,
    as in ``torch.argmax``).
    """
    return active_ops().greedy(logits)


@portable
def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """Structured outputs: forbid tokens, in place.

    logits: [B, V] float32; bitmask: [B, ceil(V / 32)] int32, bit ``t % 32`` (least significant first)
    of word ``t // 32`` set when token ``t`` is allowed (the layout llguidance and xgrammar write).
    Disallowed tokens' logits become -inf; bits past V are ignored.
    """
    active_ops().apply_token_bitmask(logits, bitmask)
