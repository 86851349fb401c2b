"""The conformance and invariance checks fail on the fast CPU backend's ops when they are broken, in
float32 and in bfloat16 (whose looser tolerance must not hide a real bug): each case replaces one op
of the fast backend by a broken version of that same op and expects the check to name it.

Deterministic-mode cases break the op's invariant formulation (the native ``mla_decode_invariant`` and
``silu_and_mul`` kernels, the padded grouped products) and run the invariance checks, which
also compare each formulation with the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.backends.cpu import attention as fast_attention
from deepinfer.backends.cpu import cache as fast_cache
from deepinfer.backends.cpu import deterministic as fast_deterministic
from deepinfer.backends.cpu import linear as fast_linear
from deepinfer.backends.cpu import moe as fast_moe
from deepinfer.backends.cpu import norm as fast_norm
from deepinfer.backends.cpu import sampling as fast_sampling
from deepinfer.backends.cpu.backend import OPS as FAST
from deepinfer.backends.registry import OpTable, interface_ops, load_backend
from deepinfer.backends.testing import checks, invariance
from deepinfer.backends.testing.harness import SMALL_MLA, SMALL_MOE, V3_MLA

FAST.finalize()
REFERENCE = load_backend("deepinfer.backends.reference")
CPU = torch.device("cpu")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def _named(name: str, fn: Callable) -> Callable:
    fn.__name__ = name
    return fn


def fast_with(fn: Callable) -> OpTable:
    """The fast backend with one op replaced by ``fn`` (named like the op it replaces)."""
    table = OpTable(f"broken-fast-{fn.__name__}")
    table.implement(fn)
    for name in sorted(set(interface_ops()) - {fn.__name__}):
        table.implement(FAST.implementation(name))
    return table.finalize()


def fast_deterministic_with(fn: Callable) -> OpTable:
    """The fast backend as deterministic mode runs it, with one op's invariant formulation replaced."""
    table = OpTable(f"broken-fast-deterministic-{fn.__name__}")
    for name in sorted(interface_ops()):
        table.implement(FAST.default_implementation(name))
        table.implement_invariant("as the fast backend")(
            fn if name == fn.__name__ else FAST.deterministic_implementation(name)
        )
    return table.finalize()


def _decode_scaled(kernel: Callable) -> Callable:
    def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                   sliding_window=None):  # fmt: skip
        return kernel(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                      scale * 1.05, sliding_window)  # fmt: skip

    return mla_decode


def _decode_without_window(kernel: Callable) -> Callable:
    def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                   sliding_window=None):  # fmt: skip
        return kernel(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                      None)  # fmt: skip

    return mla_decode


def _one_row_off(x, weight, eps):
    out = fast_norm.rms_norm(x, weight, eps)
    out[out.shape[0] // 2 - 83] *= 1.05  # one row in a thousand, 5% off
    return out


def _unwritten_last_row(x, weight, eps):
    out = fast_norm.rms_norm(x, weight, eps)
    out[-1] = float("nan")  # as if the last row were never written
    return out


def _linear_one_row_without_bias(x, weight, bias):  # a decode batch of one loses its bias
    return fast_linear.linear(x, weight, None if x.shape[0] == 1 else bias)


def _linear_columns_read_as_rows(x, weight, bias):  # a transposed-view weight read with rows' strides
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[0] > 1:
        weight = weight.t().contiguous().view(weight.shape)
    return fast_linear.linear(x, weight, bias)


def _linear_skinny_last_column(x, weight, bias):  # few rows: the last output column left unwritten
    out = fast_linear.linear(x, weight, bias)
    if x.shape[0] <= 8:
        out[..., -1] = float("nan")
    return out


def _greedy_last_of_ties(logits):  # ties to the highest index
    flipped = logits.flip(-1)
    return logits.shape[-1] - 1 - fast_sampling.greedy(flipped)


def _greedy_ignores_nan(logits):  # NaN skipped as if it were -inf
    return fast_sampling.greedy(torch.nan_to_num(logits, nan=float("-inf")))


def rope(q, k, positions, cos_sin_cache, interleaved):  # the other pairing
    return fast_norm.rope(q, k, positions, cos_sin_cache, not interleaved)


def add_rms_norm(x, residual, weight, eps):  # normalises x alone, not x + residual
    return fast_norm.rms_norm(x, weight, eps), fast_norm.add_rms_norm(x, residual, weight, eps)[1]


def kv_cache_write(kv_c, k_pe, kv_cache, slot_mapping):  # rows to each other's slots
    fast_cache.kv_cache_write(kv_c, k_pe, kv_cache, slot_mapping.flip(0))


def grouped_gemm(x, weight, group_sizes):  # group boundaries shifted by one expert
    return fast_moe.grouped_gemm(x, weight, group_sizes.roll(1))


def fused_moe(hidden, w13, w2, topk_weights, topk_ids):  # routing weights dropped
    return fast_moe.fused_moe(hidden, w13, w2, torch.ones_like(topk_weights), topk_ids)


def _moe_next_expert(hidden, w13, w2, topk_weights, topk_ids):  # each local pair through the next expert
    shifted = torch.where(topk_ids >= 0, (topk_ids + 1) % w13.shape[0], topk_ids)
    return fast_moe.fused_moe(hidden, w13, w2, topk_weights, shifted)


def _moe_dropped_pair(hidden, w13, w2, topk_weights, topk_ids):  # the last token's last pair left out
    ids = topk_ids.clone()
    ids[-1, -1] = -1
    return fast_moe.fused_moe(hidden, w13, w2, topk_weights, ids)


def _moe_weights_to_other_slots(hidden, w13, w2, topk_weights, topk_ids):  # weight j applied to pair j+1
    return fast_moe.fused_moe(hidden, w13, w2, topk_weights.roll(1, dims=1), topk_ids)


def _moe_remote_as_local(hidden, w13, w2, topk_weights, topk_ids):  # another rank's pairs run on expert 0
    return fast_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids.clamp(min=0))


def _route_with(**broken) -> Callable:
    """moe_route with some of its arguments replaced (a kernel that ignores them)."""

    def moe_route(router_logits, correction_bias, top_k, n_group, topk_group, scoring_func, topk_method,
                  renormalize, routed_scaling_factor):  # fmt: skip
        args = dict(
            router_logits=router_logits, correction_bias=correction_bias, top_k=top_k, n_group=n_group,
            topk_group=topk_group, scoring_func=scoring_func, topk_method=topk_method,
            renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
        args.update({k: fn(args) for k, fn in broken.items()})
        return fast_moe.moe_route(**args)

    return moe_route


def _check_route_ties(table: OpTable, dtype: torch.dtype) -> None:
    """Integer logits and a zero bias: many tied scores, group scores and boundaries between chosen and
    left experts. The experts chosen must be the reference's (their order is unspecified)."""
    logits = torch.randint(-2, 3, (64, 16), generator=torch.Generator().manual_seed(0)).float()
    args = (logits, torch.zeros(16), 4, 4, 2, "sigmoid", "noaux_tc", True, 2.5)
    ids = table.moe_route(*args)[1].sort(dim=-1).values
    ref = REFERENCE.moe_route(*args)[1].sort(dim=-1).values
    if not torch.equal(ids, ref):
        raise AssertionError(f"moe_route ties: {int((ids != ref).any(dim=-1).sum())} of 64 tokens differ")


def silu_and_mul_invariant(x):  # gate and up swapped
    return fast_norm.silu_and_mul(x.roll(x.shape[-1] // 2, dims=-1))


def fused_moe_invariant(hidden, w13, w2, topk_weights, topk_ids):  # routing weights dropped
    return fast_deterministic.fused_moe(hidden, w13, w2, torch.ones_like(topk_weights), topk_ids)


def grouped_gemm_invariant(x, weight, group_sizes):  # group boundaries shifted by one expert
    return fast_deterministic.grouped_gemm(x, weight, group_sizes.roll(1))


# (id, broken op, the check it must fail, what the failure must say)
Mutation = tuple[str, Callable, Callable[[OpTable, torch.dtype], None], str]
MUTATIONS: list[Mutation] = [
    (
        "greedy-ties-to-the-highest-index",
        _named("greedy", _greedy_last_of_ties),
        lambda t, d: checks.check_greedy(t, CPU, 1000, "m-ties"),
        r"greedy\[m-ties\]: rows",
    ),
    (
        "greedy-ignores-nan",
        _named("greedy", _greedy_ignores_nan),
        lambda t, d: checks.check_greedy(t, CPU, 1000, "m-nan"),
        r"greedy\[m-nan\]: rows \[3, 4, 5\]",
    ),
    (
        "linear-one-row-drops-bias",
        _named("linear", _linear_one_row_without_bias),
        lambda t, d: checks.check_linear(t, CPU, d, 64, 48, 0, "m-bias"),
        r"linear\[m-bias, 1 rows",
    ),
    (
        "linear-columns-read-as-rows",
        _named("linear", _linear_columns_read_as_rows),
        lambda t, d: checks.check_linear(t, CPU, d, 37, 19, 0, "m-layout"),
        r"linear\[m-layout, 1 rows, columns\]",
    ),
    (
        "linear-skinny-last-column-unwritten",
        _named("linear", _linear_skinny_last_column),
        lambda t, d: checks.check_linear(t, CPU, d, 33, 50, 3, "m-column"),
        r"linear\[m-column, 1 rows, rows\].*non-finite",
    ),
    (
        "mla_decode-mis-scaled",
        _decode_scaled(fast_attention.mla_decode),
        lambda t, d: checks.check_mla_decode(t, CPU, d, V3_MLA, [1, 2, 1], None, "m-scaled"),
        r"mla_decode.*relative error",
    ),
    (
        "mla_decode-ignores-window",
        _decode_without_window(fast_attention.mla_decode),
        lambda t, d: checks.check_mla_decode(t, CPU, d, SMALL_MLA, [1, 3, 2, 4], 24, "m-window"),
        r"mla_decode",
    ),
    (
        "rope-wrong-pairing",
        rope,
        lambda t, d: checks.check_rope(t, CPU, d, SMALL_MLA, True, "m-pairing"),
        "rope",
    ),
    (
        "rms_norm-one-row-in-a-thousand",
        _named("rms_norm", _one_row_off),
        lambda t, d: checks.check_rms_norm(t, CPU, d, 64, "m-row", rows=1000),
        r"rms_norm\[m-row\]: relative error [45]\.\d+e-02 of its worst row \(of 1000\)",
    ),
    (
        "rms_norm-unwritten-row",
        _named("rms_norm", _unwritten_last_row),
        lambda t, d: checks.check_rms_norm(t, CPU, d, 64, "m-unwritten"),
        "non-finite",
    ),
    (
        "add_rms_norm-ignores-residual-in-norm",
        add_rms_norm,
        lambda t, d: checks.check_rms_norm(t, CPU, d, 64, "m-residual"),
        r"add_rms_norm\.norm",
    ),
    (
        "kv_cache_write-swaps-slots",
        kv_cache_write,
        lambda t, d: checks.check_kv_cache(t, CPU, d, SMALL_MLA, "m-slots"),
        r"kv_cache\.latent",
    ),
    (
        "grouped_gemm-groups-shifted",
        grouped_gemm,
        lambda t, d: checks.check_grouped_gemm(t, CPU, d, SMALL_MOE, "m-groups"),
        "grouped_gemm",
    ),
    (
        "fused_moe-drops-routing-weights",
        fused_moe,
        lambda t, d: checks.check_fused_moe(t, CPU, d, SMALL_MOE, False, "m-weights"),
        "fused_moe",
    ),
    (
        "fused_moe-wrong-expert",
        _named("fused_moe", _moe_next_expert),
        lambda t, d: checks.check_fused_moe(t, CPU, d, SMALL_MOE, False, "m-expert"),
        "fused_moe",
    ),
    (
        "fused_moe-drops-one-pair",
        _named("fused_moe", _moe_dropped_pair),
        lambda t, d: checks.check_fused_moe(t, CPU, d, SMALL_MOE, False, "m-pair"),
        "fused_moe",
    ),
    (
        "fused_moe-weights-to-other-slots",
        _named("fused_moe", _moe_weights_to_other_slots),
        lambda t, d: checks.check_fused_moe(t, CPU, d, SMALL_MOE, False, "m-slots"),
        "fused_moe",
    ),
    (
        "fused_moe-computes-remote-pairs",
        _named("fused_moe", _moe_remote_as_local),
        lambda t, d: checks.check_fused_moe(t, CPU, d, SMALL_MOE, True, "m-remote"),
        "fused_moe",
    ),
    (
        "moe_route-misses-scaling",
        _route_with(routed_scaling_factor=lambda a: 1.0),
        lambda t, d: checks.check_moe_route(t, CPU, SMALL_MOE, "sigmoid", "noaux_tc", True, "m-scale"),
        r"moe_route\.weights",
    ),
    (
        "moe_route-misses-renormalisation",
        _route_with(renormalize=lambda a: False),
        lambda t, d: checks.check_moe_route(t, CPU, SMALL_MOE, "sigmoid", "noaux_tc", True, "m-renorm"),
        r"moe_route\.weights",
    ),
    (
        "moe_route-ignores-groups",
        _route_with(topk_group=lambda a: a["n_group"]),
        lambda t, d: checks.check_moe_route(t, CPU, SMALL_MOE, "sigmoid", "noaux_tc", True, "m-groups"),
        "chose different experts",
    ),
    (
        "moe_route-ignores-bias",
        _route_with(correction_bias=lambda a: torch.zeros_like(a["correction_bias"])),
        lambda t, d: checks.check_moe_route(t, CPU, SMALL_MOE, "sigmoid", "noaux_tc", True, "m-bias"),
        "chose different experts",
    ),
    (
        "moe_route-group-limited-greedy-as-greedy",
        _route_with(topk_method=lambda a: "greedy"),
        lambda t, d: checks.check_moe_route(
            t, CPU, SMALL_MOE, "softmax", "group_limited_greedy", True, "m-g"
        ),
        "chose different experts",
    ),
    (
        "moe_route-ties-to-the-higher-index",
        _route_with(
            router_logits=lambda a: a["router_logits"] + 1e-6 * torch.arange(a["router_logits"].shape[1])
        ),
        _check_route_ties,
        "moe_route ties",
    ),
]

DETERMINISTIC_MUTATIONS: list[Mutation] = [
    (
        "mla_decode_invariant-mis-scaled",
        _decode_scaled(fast_deterministic.mla_decode),
        lambda t, d: invariance.check_attention(t, CPU, d, SMALL_MLA, None, "md-scaled"),
        r"mla_decode\(deterministic\)",
    ),
    (
        "mla_decode_invariant-ignores-window",
        _decode_without_window(fast_deterministic.mla_decode),
        lambda t, d: invariance.check_attention(t, CPU, d, SMALL_MLA, 24, "md-window"),
        r"mla_decode\(deterministic\)",
    ),
    (
        "silu_and_mul_invariant-halves-swapped",
        _named("silu_and_mul", silu_and_mul_invariant),
        lambda t, d: invariance.check_rowwise_small_ops(t, CPU, d, 40, "md-silu"),
        r"silu_and_mul\(deterministic\)",
    ),
    (
        "fused_moe_invariant-drops-routing-weights",
        _named("fused_moe", fused_moe_invariant),
        lambda t, d: invariance.check_moe(t, CPU, d, SMALL_MOE, "md-weights"),
        r"fused_moe\(deterministic\)",
    ),
    (
        "grouped_gemm_invariant-groups-shifted",
        _named("grouped_gemm", grouped_gemm_invariant),
        lambda t, d: invariance.check_moe(t, CPU, d, SMALL_MOE, "md-groups"),
        "grouped_gemm",
    ),
]


@DTYPES
@pytest.mark.parametrize("broken,check,message", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_the_suite_catches_a_broken_fast_op(broken, check, message, dtype) -> None:
    check(FAST, dtype)  # the unbroken op passes the same check
    with pytest.raises(AssertionError, match=message):
        check(fast_with(broken), dtype)


@DTYPES
@pytest.mark.parametrize(
    "broken,check,message",
    [m[1:] for m in DETERMINISTIC_MUTATIONS],
    ids=[m[0] for m in DETERMINISTIC_MUTATIONS],
)
def test_the_suite_catches_a_broken_fast_invariant_formulation(broken, check, message, dtype) -> None:
    check(fast_deterministic_with(FAST.deterministic_implementation(broken.__name__)), dtype)
    with pytest.raises(AssertionError, match=message):
        check(fast_deterministic_with(broken), dtype)


def test_fast_decode_with_a_shifted_block_table_entry_fails() -> None:
    with pytest.raises(AssertionError, match="mla_decode"):
        checks.check_mla_decode(FAST, CPU, torch.float32, SMALL_MLA, [1, 1, 1, 1], None, "shift",
                                corrupt_block_table=True)  # fmt: skip


def test_the_batch_split_decode_kernel_as_deterministic_attention_is_caught() -> None:
    """The default kernel cuts the KV by the batch's total length: not invariant, and the check says so."""
    with pytest.raises(AssertionError, match="mla_decode: not batch-invariant"):
        invariance.check_attention(
            fast_deterministic_with(fast_attention.mla_decode), CPU, torch.float32, SMALL_MLA, None, "split"
        )


def test_the_at_mm_expert_path_as_deterministic_moe_is_caught() -> None:
    """fused_moe's large-row path (at::mm over each expert's rows, whatever their count) is not
    batch-invariant: a needle alone is a 1-row product there. The check must say so."""

    def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
        return torch.ops.deepinfer_cpu.fused_moe(hidden, w13, w2, topk_weights, topk_ids, 1)

    with pytest.raises(AssertionError, match="not batch-invariant"):
        invariance.check_moe(fast_deterministic_with(fused_moe), CPU, torch.float32, SMALL_MOE, "grp")
