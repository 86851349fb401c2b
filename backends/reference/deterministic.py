"""The reference backend in deterministic mode: which ops are batch-invariant as they are, and the
invariant formulations of the others (built from ``invariant``'s padded row counts and fixed KV splits).

The model runs every token through ``mla_decode`` in this mode (the engine routes prompt chunks to the
absorbed path too), so a token's attention is one computation whether it is decoded, part of a prompt
chunk, a speculative draft being verified, or follows a prefix read from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.quant import WeightFormat, dequantize
from deepinfer.backends.reference import OPS
from deepinfer.backends.reference.invariant import (
    KV_SPLIT,
    ROW_TILE,
    split_kv_attention,
    tiled_grouped,
    tiled_linear,
    vector_lanes,
)
from deepinfer.backends.reference.moe import route

ONE_SHAPE = (
    f"every product's row count zero padded to a multiple of {ROW_TILE} (the BLAS then rounds a row the "
    "same whatever the row count)"
)


@OPS.implement_invariant("silu on vector lanes only (no scalar tail, no size-dependent thread split)")
def silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return vector_lanes(F.silu, gate) * up


@OPS.implement_invariant(ONE_SHAPE)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if x.dim() == 3:
        if bias is not None:
            raise ValueError("linear: a per-head weight [H, N, K] takes no bias")
        return torch.stack([tiled_linear(x[:, h], weight[h]) for h in range(x.shape[1])], dim=1)
    return tiled_linear(x, weight, bias)


@OPS.implement_invariant(ONE_SHAPE + "; one product per expert")
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    return tiled_grouped(x, weight, group_sizes.tolist())


@OPS.implement_invariant(
    ONE_SHAPE + " per expert; each token's k expert outputs are added in ascending expert id order"
)
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    ids, slot = topk_ids.long().sort(dim=1, stable=True)  # remote experts (id < 0) first: they add 0
    weights = topk_weights.float().gather(1, slot)
    expert_of_pair = ids.reshape(-1)
    token_of_pair = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
    local = expert_of_pair >= 0
    order = torch.argsort(torch.where(local, expert_of_pair, num_experts), stable=True)
    rows = order[: int(local.sum())]
    sizes = torch.bincount(expert_of_pair[rows], minlength=num_experts).tolist()
    gate_up = tiled_grouped(hidden.index_select(0, token_of_pair[rows]), w13, sizes)
    expert_out = tiled_grouped(silu_and_mul(gate_up), w2, sizes)
    per_pair = torch.zeros(num_tokens * top_k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    per_pair[rows] = expert_out.float()
    per_pair = per_pair.view(num_tokens, top_k, -1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for j in range(top_k):
        out += weights[:, j, None] * per_pair[:, j]
    return out.to(hidden.dtype)


def _sum_in_order(weights: Tensor) -> Tensor:
    """[T, k] -> [T, 1]: w0 + w1 + ... left to right (torch's sum over a short last dimension changes
    its order with the number of rows: seen with k = 3 on one row against two)."""
    total = weights[:, :1].clone()
    for j in range(1, weights.shape[1]):
        total += weights[:, j : j + 1]
    return total


@OPS.implement_invariant(
    "per-row scores (sigmoid on vector lanes only), group scores and top-k; each token's k weights "
    "renormalised by a left-to-right sum"
)
def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    return route(
        router_logits, correction_bias, top_k, n_group, topk_group, scoring_func, topk_method, renormalize,
        routed_scaling_factor, _sum_in_order, lambda x: vector_lanes(torch.sigmoid, x),
    )  # fmt: skip


@OPS.implement_invariant(
    f"keys cut every {KV_SPLIT} positions from 0; scores as one product over the head width, the "
    "softmax from each row's maximum over all its keys, each split's weighted values as one product, "
    "splits added in ascending order; row counts padded to a multiple of "
    f"{ROW_TILE}: a query token's bits depend only on its own query and keys"
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
    queries = torch.cat((q_nope, q_pe), dim=-1).float()  # the cache row's order: latent, then rope
    out = split_kv_attention(
        queries, (cache.view(-1, cache.shape[-1]),), block_table, cache.shape[1], seq_lens.tolist(),
        query_start_loc.tolist(), q_nope.shape[-1], scale, sliding_window,
    )  # fmt: skip
    return out.to(q_nope.dtype)


OPS.declare_invariant(
    ["rms_norm", "add_rms_norm"],
    "one reduction per row over the hidden size, in an order torch fixes by that size (a reduction is "
    "split across threads only past 32768 elements with one output row)",
)
OPS.declare_invariant(
    ["rope", "apply_token_bitmask"], "elementwise per row: multiplications, additions, copies"
)
OPS.declare_invariant(
    ["kv_cache_spec", "kv_cache_write", "kv_cache_gather"], "layout and row copies: no arithmetic"
)
OPS.declare_invariant(
    ["mla_prefill"],
    "one attention call per request, so batch mates never share its arithmetic; NOT invariant to how "
    "the request's prompt is chunked, which is why deterministic mode runs every token through "
    "mla_decode",
)
OPS.declare_invariant(
    ["sample"], "per row: counter-based noise from (seed, offset, token) and per-row softmax, filters, argmax"
)
OPS.declare_invariant(["greedy"], "per row: an index comparison, no arithmetic")
OPS.declare_invariant(["ep_dispatch"], "row copies and exchange: no arithmetic")
OPS.declare_invariant(
    ["ep_combine"],
    "each token's expert outputs are weighted elementwise and added in the token's own send order "
    "(ascending destination rank, then its top-k slot), whatever other tokens were sent",
)
OPS.declare_invariant(
    ["quant_fp8_group"], "per row: one amax and one division per group, no cross-row arithmetic"
)


@OPS.implement_invariant(ONE_SHAPE + " on the dequantised weight")
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    w = dequantize(weight, weight_scale, WeightFormat("fp8", tuple(block)))
    return tiled_linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


@OPS.implement_invariant(ONE_SHAPE + " on the dequantised activations and weight")
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    x = dequantize(x_values, x_scale, WeightFormat("fp8", (1, block[1])))
    w = dequantize(weight, weight_scale, WeightFormat("fp8", tuple(block)))
    return tiled_linear(x, w, None if bias is None else bias.float()).to(out_dtype)


@OPS.implement_invariant(ONE_SHAPE + " per expert, on the dequantised weights")
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    return tiled_grouped(x.float(), dequantize(weight, weight_scale, fmt), group_sizes.tolist()).to(x.dtype)


@OPS.implement_invariant("the invariant fused_moe on the dequantised weights")
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
    w13_f, w2_f = dequantize(w13, w13_scale, fmt), dequantize(w2, w2_scale, fmt)
    return fused_moe(hidden.float(), w13_f, w2_f, topk_weights, topk_ids).to(hidden.dtype)
