"""A torch_npu call built wrong must fail: the emulation raises where the documentation forbids an
argument, and computes with the documented defaults (so a forgotten ``scale`` gives wrong numbers)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer.backends.registry import OpTable
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA, SMALL_MOE, V3_MLA
from deepinfer.ops_ascend import decode, prefill

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def rewrite_calls(
    monkeypatch: pytest.MonkeyPatch, op: str, rewrite: Callable[[dict[str, Any]], None]
) -> None:
    """Route every ``torch_npu.<op>`` call through ``rewrite(kwargs)`` first (a deliberately broken caller)."""
    npu = sys.modules["torch_npu"]
    real = getattr(npu, op)

    def broken(*args: Any, **kwargs: Any) -> Any:
        rewrite(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(npu, op, broken)


def per_request(cumulative: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *cumulative], cumulative)]


def test_the_correct_calls_pass(ascend_ops: OpTable) -> None:
    checks.check_mla_prefill(ascend_ops, CPU, BF16, SMALL_MLA, None, "ok-prefill")
    checks.check_mla_decode(ascend_ops, CPU, BF16, SMALL_MLA, [1, 3, 2, 4], None, "ok-decode")
    checks.check_kv_cache(ascend_ops, CPU, BF16, SMALL_MLA, "ok-kv")


def test_per_request_query_lengths_in_decode_fail(
    ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lengths(seq_lens: list[int], starts: list[int]) -> dict[str, list[int]]:
        return {"actual_seq_qlen": per_request(list(starts[1:])), "actual_seq_kvlen": list(seq_lens)}

    monkeypatch.setattr(decode, "tnd_lengths", lengths)
    for query_lens in ([1, 3, 2, 4], [1, 1, 1, 1]):
        with pytest.raises(RuntimeError, match="actual_seq_qlen"):
            checks.check_mla_decode(ascend_ops, CPU, BF16, SMALL_MLA, query_lens, None, f"bad-{query_lens}")


def test_cumulative_kv_lengths_in_paged_decode_fail(
    ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    rewrite_calls(
        monkeypatch,
        "npu_fused_infer_attention_score_v2",
        lambda kw: kw.update(actual_seq_kvlen=torch.tensor(kw["actual_seq_kvlen"]).cumsum(0).tolist()),
    )
    # Cumulative lengths run past the request's blocks: beyond the table (an error) or into NaN blocks.
    with pytest.raises((RuntimeError, AssertionError), match=r"kv length beyond|non-finite"):
        checks.check_mla_decode(ascend_ops, CPU, BF16, SMALL_MLA, [1, 1, 1, 1], None, "bad-kv")


def test_per_request_lengths_in_prefill_fail(ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch) -> None:
    rewrite_calls(
        monkeypatch,
        "npu_fused_infer_attention_score_v2",
        lambda kw: kw.update(
            actual_seq_qlen=per_request(kw["actual_seq_qlen"]),
            actual_seq_kvlen=per_request(kw["actual_seq_kvlen"]),
        ),
    )
    with pytest.raises(RuntimeError, match="cumulative"):
        checks.check_mla_prefill(ascend_ops, CPU, BF16, SMALL_MLA, None, "bad-prefill")


@pytest.mark.parametrize("attention", ["prefill", "decode"])
def test_default_scale_gives_wrong_results(
    ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch, attention: str
) -> None:
    rewrite_calls(monkeypatch, "npu_fused_infer_attention_score_v2", lambda kw: kw.pop("softmax_scale"))
    with pytest.raises(AssertionError, match="relative error"):
        if attention == "prefill":
            checks.check_mla_prefill(ascend_ops, CPU, BF16, V3_MLA, None, "no-scale")
        else:
            checks.check_mla_decode(ascend_ops, CPU, BF16, V3_MLA, [1, 1, 1, 1], None, "no-scale")


def test_default_cache_mode_fails(ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch) -> None:
    rewrite_calls(monkeypatch, "npu_scatter_pa_kv_cache", lambda kw: kw.pop("cache_mode"))
    with pytest.raises(RuntimeError, match="PA_NZ"):
        checks.check_kv_cache(ascend_ops, CPU, BF16, V3_MLA, "nz-default")


def test_a_wrong_mask_fails(ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch) -> None:
    rewrite_calls(
        monkeypatch,
        "npu_fused_infer_attention_score_v2",
        lambda kw: kw.update(atten_mask=1 - kw["atten_mask"]),
    )
    with pytest.raises(RuntimeError, match="lower-triangular"):
        checks.check_mla_prefill(ascend_ops, CPU, BF16, SMALL_MLA, None, "bad-mask")


def test_no_mask_for_multi_query_decode_fails(ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch) -> None:
    rewrite_calls(
        monkeypatch,
        "npu_fused_infer_attention_score_v2",
        lambda kw: kw.update(sparse_mode=0, atten_mask=None),
    )
    with pytest.raises(RuntimeError, match="sparse_mode 3"):
        checks.check_mla_decode(ascend_ops, CPU, BF16, SMALL_MLA, [1, 3, 2, 4], None, "no-mask")


def test_remote_expert_ids_must_be_dropped_not_passed(npu_emulation: None) -> None:
    npu = sys.modules["torch_npu"]
    with pytest.raises(RuntimeError, match=r"expert ids must lie in \[0, expert_num\)"):
        npu.npu_moe_init_routing_v2(
            torch.randn(2, 8),
            torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
            expert_num=4,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
        )


def test_unpermute_needs_a_permutation(npu_emulation: None) -> None:
    npu = sys.modules["torch_npu"]
    with pytest.raises(RuntimeError, match="permutation"):
        npu.npu_moe_token_unpermute(
            torch.randn(4, 8), torch.tensor([0, 1, 2, -1], dtype=torch.int32), probs=torch.ones(2, 2)
        )


def test_fused_moe_with_remote_experts_stays_exact(ascend_ops: OpTable) -> None:
    """Remote pairs are dropped by active_expert_range and their rows never reach the combine (the
    emulation leaves them NaN, so a leak would show)."""
    checks.check_fused_moe(ascend_ops, CPU, torch.float32, SMALL_MOE, True, "remote")


def test_gating_bias_must_match_the_logits_dtype(npu_emulation: None) -> None:
    npu = sys.modules["torch_npu"]
    with pytest.raises(RuntimeError, match="bias"):
        npu.npu_moe_gating_top_k(
            torch.randn(3, 16),
            2,
            bias=torch.randn(16, dtype=torch.float64),
            k_group=2,
            group_count=4,
            group_select_mode=1,
            norm_type=1,
        )


def test_per_request_prefill_lengths_are_caught_even_when_increasing(npu_emulation: None) -> None:
    npu = sys.modules["torch_npu"]
    q = torch.randn(6, 8, 192, dtype=BF16)
    v = torch.randn(6, 8, 128, dtype=BF16)
    with pytest.raises(RuntimeError, match="must end at the token count"):
        npu.npu_fused_infer_attention_score_v2(
            q,
            q,
            v,
            actual_seq_qlen=[1, 2, 3],
            actual_seq_kvlen=[1, 2, 3],
            num_query_heads=8,
            input_layout="TND",
            softmax_scale=0.1,
        )


def test_prefill_widths_are_checked(ascend_ops: OpTable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill, "TND_WIDTHS", ((160, 160),))
    with pytest.raises(RuntimeError, match="Q_D/K_D/V_D"):
        checks.check_mla_prefill(ascend_ops, CPU, BF16, SMALL_MLA, None, "widths")
