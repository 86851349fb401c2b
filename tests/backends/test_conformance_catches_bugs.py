"""The conformance checks fail on deliberately broken kernels (a suite that cannot fail proves nothing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deepinfer.backends.reference import attention, moe, rope, sampling
from deepinfer.backends.registry import OpTable, interface_ops
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA, SMALL_MOE, TOLERANCE, V3_MLA, assert_close

CPU = torch.device("cpu")


def table_with(fn: Callable) -> OpTable:
    """The reference backend with one op replaced by ``fn`` (named like the op it replaces)."""
    table = OpTable(f"broken-{fn.__name__}")
    table.implement(fn)
    table.use_reference_for(sorted(set(interface_ops()) - {fn.__name__}), "test")
    return table.finalize()


def test_mis_scaled_softmax_in_mla_decode_fails() -> None:
    def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                   sliding_window=None):  # fmt: skip
        return attention.mla_decode(
            q_nope,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            max_query_len,
            scale * 1.05,
            sliding_window,
        )

    checks.check_mla_decode(
        table_with(attention.mla_decode), CPU, torch.float32, SMALL_MLA, [1, 2, 1], None, "ok"
    )
    with pytest.raises(AssertionError, match=r"mla_decode.*relative error"):
        checks.check_mla_decode(table_with(mla_decode), CPU, torch.float32, V3_MLA, [1, 2, 1], None, "scaled")


def test_shifted_block_table_entry_fails() -> None:
    with pytest.raises(AssertionError, match="mla_decode"):
        checks.check_mla_decode(
            table_with(attention.mla_decode), CPU, torch.float32, SMALL_MLA, [1, 1, 1, 1], None, "shift",
            corrupt_block_table=True,
        )  # fmt: skip


def test_ignored_sliding_window_fails() -> None:
    def mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sliding_window=None
    ):
        return attention.mla_prefill(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, None
        )

    with pytest.raises(AssertionError, match="mla_prefill"):
        checks.check_mla_prefill(table_with(mla_prefill), CPU, torch.float32, SMALL_MLA, 4, "window")


def test_top_left_causal_mask_fails() -> None:
    """Aligning the causal mask to the top-left ignores the cached context of a chunked prefill."""

    def mla_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sliding_window=None
    ):
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            qb, kb, vb = (
                t.transpose(0, 1) for t in (q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]])
            )
            mask = torch.ones(qb.shape[1], kb.shape[1], dtype=torch.bool).tril()
            out[cq[b] : cq[b + 1]] = torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=mask, scale=scale
            ).transpose(0, 1)
        return out

    with pytest.raises(AssertionError, match="mla_prefill"):
        checks.check_mla_prefill(table_with(mla_prefill), CPU, torch.float32, SMALL_MLA, None, "topleft")


def test_rope_with_wrong_pairing_fails() -> None:
    def rope_impl(q, k, positions, cos_sin_cache, interleaved):
        return rope.rope(q, k, positions, cos_sin_cache, not interleaved)

    rope_impl.__name__ = "rope"
    with pytest.raises(AssertionError, match="rope"):
        checks.check_rope(table_with(rope_impl), CPU, torch.float32, SMALL_MLA, True, "pairing")


def test_routing_that_ignores_the_correction_bias_fails() -> None:
    def moe_route(router_logits, correction_bias, top_k, n_group, topk_group, scoring_func, topk_method,
                  renormalize, routed_scaling_factor):  # fmt: skip
        return moe.moe_route(
            router_logits, torch.zeros_like(correction_bias), top_k, n_group, topk_group, scoring_func,
            topk_method, renormalize, routed_scaling_factor,
        )  # fmt: skip

    with pytest.raises(AssertionError, match="chose different experts"):
        checks.check_moe_route(table_with(moe_route), CPU, SMALL_MOE, "sigmoid", "noaux_tc", True, "bias")


def test_moe_that_drops_the_routing_weights_fails() -> None:
    def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
        return moe.fused_moe(hidden, w13, w2, torch.ones_like(topk_weights), topk_ids)

    with pytest.raises(AssertionError, match="fused_moe"):
        checks.check_fused_moe(table_with(fused_moe), CPU, torch.float32, SMALL_MOE, False, "weights")


def test_sampler_that_ignores_the_seed_fails() -> None:
    def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
        return sampling.sample(logits, temperature, top_k, top_p, min_p, torch.zeros_like(seeds), offsets)

    with pytest.raises(AssertionError, match="drew different tokens"):
        checks.check_sample(table_with(sample), CPU, "seed")


def test_unwritten_output_rows_fail() -> None:
    def silu_and_mul(x):
        out = sampling.torch.nn.functional.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :]
        out[-1] = float("nan")  # as if the last row were never written
        return out

    with pytest.raises(AssertionError, match="non-finite"):
        checks.check_silu_and_mul(table_with(silu_and_mul), CPU, torch.float32, 32, "unwritten")


def test_a_row_the_op_never_writes_is_nan_on_the_cpu_too() -> None:
    def silu_and_mul(x):
        half = x.shape[-1] // 2
        out = torch.empty_like(x[..., :half])  # the last row is left as allocated
        out[:-1] = torch.nn.functional.silu(x[:-1, :half]) * x[:-1, half:]
        return out

    with pytest.raises(AssertionError, match="non-finite"):
        checks.check_silu_and_mul(table_with(silu_and_mul), CPU, torch.float32, 32, "left-unwritten")


def test_one_wrong_row_in_a_thousand_fails_the_row_comparison() -> None:
    """A 5% error in one row of 1000: one relative norm over the whole tensor (the old comparison)
    sees 0.16% and lets it through at the bf16 tolerance; the worst row's error is 5%."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1000, 64, generator=gen), torch.ones(64)
    ref = attention.OPS.rms_norm(x, w, 1e-6)
    out = attention.OPS.rms_norm(x.to(torch.bfloat16), w.to(torch.bfloat16), 1e-6)
    out[417] *= 1.05
    whole_tensor_error = float((out.float() - ref).norm() / ref.norm())
    assert whole_tensor_error < TOLERANCE[torch.bfloat16]
    with pytest.raises(
        AssertionError, match=r"rms_norm: relative error 5\.\d+e-02 of its worst row \(of 1000\)"
    ):
        assert_close("rms_norm", out, ref, torch.bfloat16)
    assert_close("rms_norm", attention.OPS.rms_norm(x.to(torch.bfloat16), w.to(torch.bfloat16), 1e-6), ref,
                 torch.bfloat16)  # fmt: skip


def test_every_check_runs_its_op_over_nan_filled_memory() -> None:
    """Every check runs with uninitialised memory NaN-filled (torch's allocator, CPU and CUDA) and
    poisons the device's freed memory first (vendor caching allocators) before it calls the op
    under test; apply_token_bitmask writes in place into logits the check itself fills."""
    import inspect

    for name, fn in vars(checks).items():
        if not name.startswith("check_") or not callable(fn):
            continue
        assert hasattr(fn, "__wrapped__"), f"{name} is not decorated with @nan_filled_memory()"
        if name != "check_apply_token_bitmask":
            assert "poison_device_memory(device)" in inspect.getsource(fn), (
                f"{name} does not poison device memory"
            )
