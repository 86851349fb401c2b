"""Kernel behaviour the conformance suite does not pin down: launch configurations, schedules, edges."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.reference import OPS as REF
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA
from tests.nvidia.conftest import DEVICE

pytest.importorskip("triton")

from deepinfer.ops_cuda import mla_decode as decode
from deepinfer.ops_cuda import runtime
from deepinfer.ops_cuda.grouped_gemm import tile_schedule


def _decode_problem(gen: torch.Generator, cuda_ops, seq_lens: list[int], query_lens: list[int]):
    batch = checks.PagedBatch(cuda_ops, DEVICE, torch.float32, SMALL_MLA, seq_lens, gen)
    tokens, heads = sum(query_lens), SMALL_MLA.heads
    q_nope = torch.randn(tokens, heads, SMALL_MLA.kv_lora_rank, generator=gen).to(DEVICE)
    q_pe = torch.randn(tokens, heads, SMALL_MLA.rope, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q_nope, q_pe, batch, qsl, lens


@pytest.mark.parametrize("window", [None, 40])
def test_decode_result_does_not_depend_on_the_split_count(cuda_ops, window) -> None:
    """1 split writes the output directly; more splits go through the merge kernel, some of them empty."""
    gen = torch.Generator().manual_seed(3)
    seq_lens, query_lens = [3, 200, 64, 129], [1, 4, 2, 3]
    q_nope, q_pe, batch, qsl, lens = _decode_problem(gen, cuda_ops, seq_lens, query_lens)
    args = (q_nope, q_pe, batch.cache[0], batch.block_table.to(DEVICE), lens, qsl, 4, 0.2, window)
    outs = [
        decode.launch_decode(*args, decode.DecodeConfig(block_m, 32, splits, num_warps=4, num_stages=1))
        for block_m, splits in [(16, 1), (16, 2), (64, 3), (16, 9)]
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)
    cache, table = _as_reference_layout(batch)
    expected = REF.mla_decode(q_nope.cpu(), q_pe.cpu(), cache, table, lens.cpu(), qsl.cpu(), 4, 0.2, window)
    torch.testing.assert_close(outs[0].cpu(), expected, rtol=1e-4, atol=1e-4)


def _as_reference_layout(batch: checks.PagedBatch) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """The 64-token-block cache and table as the reference's 16-token blocks (the same slots)."""
    cache = batch.cache[0].cpu()
    split = 64 // 16
    table = (batch.block_table[:, :, None] * split + torch.arange(split, dtype=torch.int32)).flatten(1)
    return (cache.view(-1, 16, cache.shape[-1]),), table


def test_decode_config_follows_the_device() -> None:
    h200 = runtime.DeviceLimits(sm_count=132, shared_memory=227 * 1024, capability=(9, 0))
    # DeepSeek-V3 decode: batch 64, 128 heads, 4096-token context, bf16.
    cfg = decode.decode_config(h200, 2, 64, 128, 4096, 576)
    assert (cfg.block_m, cfg.block_n) == (64, 32)
    assert cfg.num_splits == 3  # 64 requests x 2 head blocks x 3 splits: about two waves of 132 SMs
    assert decode.decode_config(h200, 2, 1, 128, 4096, 576).num_splits == 32  # capped: 4 tiles a split
    assert decode.decode_config(h200, 4, 64, 128, 4096, 576).block_m == 16  # float32 tiles
    small_smem = runtime.DeviceLimits(sm_count=84, shared_memory=99 * 1024, capability=(8, 9))
    assert decode.decode_config(small_smem, 2, 64, 128, 4096, 576).num_stages == 1


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_schedule_covers_each_row_once_within_one_expert(block_m: int) -> None:
    sizes = torch.tensor([0, 5, 16, 0, 33, 1, 0, 64, 2])
    schedule = tile_schedule(sizes, int(sizes.sum()) + 7, block_m)  # 7 trailing rows belong to nobody
    expert_of_row = torch.arange(sizes.numel()).repeat_interleave(sizes)
    covered = torch.zeros(int(sizes.sum()) + 7, dtype=torch.int64)
    for e, start, end in zip(schedule.expert.tolist(), schedule.start.tolist(), schedule.end.tolist()):
        if e < 0:
            continue
        assert 0 < end - start <= block_m
        assert set(expert_of_row[start:end].tolist()) == {e}
        covered[start:end] += 1
    assert covered[: int(sizes.sum())].eq(1).all() and covered[int(sizes.sum()) :].eq(0).all()


def test_fused_moe_with_every_expert_remote_is_zero(cuda_ops) -> None:
    hidden = torch.randn(5, 64, device=DEVICE)
    w13, w2 = torch.randn(4, 64, 64, device=DEVICE), torch.randn(4, 64, 32, device=DEVICE)
    ids = torch.full((5, 2), -1, dtype=torch.int32, device=DEVICE)
    out = cuda_ops.fused_moe(hidden, w13, w2, torch.ones(5, 2, device=DEVICE), ids)
    assert torch.equal(out.cpu(), torch.zeros(5, 64))


def test_kv_cache_write_skips_padding_and_casts(cuda_ops) -> None:
    (cache,) = cuda_ops.kv_cache_spec(32, 16, torch.float16).allocate(2, DEVICE)
    cache.fill_(7.0)
    kv_c, k_pe = torch.randn(3, 32, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    cuda_ops.kv_cache_write(kv_c, k_pe, (cache,), torch.tensor([70, -1, 3], device=DEVICE))
    rows = cache.view(-1, 48).cpu()
    assert torch.equal(rows[70], torch.cat((kv_c[0], k_pe[0])).half().cpu())
    assert torch.equal(rows[3], torch.cat((kv_c[2], k_pe[2])).half().cpu())
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[[70, 3]] = False
    assert rows[untouched].eq(7.0).all()


def test_strided_inputs(cuda_ops) -> None:
    """Views as the model passes them: q_pe sliced out of q, a 3-D norm input, a transposed weight."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 48, generator=gen).to(DEVICE)
    q_pe, k = q[..., 32:], torch.randn(6, 16, generator=gen).to(DEVICE)
    positions = torch.randint(0, 100, (6,), generator=gen).to(DEVICE)
    table = checks.cos_sin_table(16, 100).to(DEVICE)
    got = cuda_ops.rope(q_pe, k, positions, table, True)
    want = REF.rope(q_pe.cpu(), k.cpu(), positions.cpu(), table.cpu(), True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
    x = torch.randn(2, 3, 64, generator=gen).to(DEVICE)
    torch.testing.assert_close(cuda_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).cpu(),
                               REF.rms_norm(x.cpu(), torch.ones(64), 1e-6))  # fmt: skip
    weight = torch.randn(3, 8, 32, generator=gen).transpose(1, 2).to(DEVICE)  # [E, Nout=32, K=8], K strided
    x = torch.randn(7, 8, generator=gen).to(DEVICE)
    sizes = torch.tensor([2, 0, 5], device=DEVICE)
    torch.testing.assert_close(cuda_ops.grouped_gemm(x, weight, sizes).cpu(),
                               REF.grouped_gemm(x.cpu(), weight.cpu(), sizes.cpu()), rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("method", ["noaux_tc", "group_limited_greedy"])
def test_routing_with_experts_not_a_power_of_two(cuda_ops, method: str) -> None:
    gen = torch.Generator().manual_seed(11)
    logits, bias = torch.randn(9, 24, generator=gen), torch.randn(24, generator=gen) * 0.1
    scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    args = (6, 4, 2, scoring, method, True, 1.5)
    w, ids = cuda_ops.moe_route(logits.to(DEVICE), bias.to(DEVICE), *args)
    ref_w, ref_ids = REF.moe_route(logits, bias, *args)
    order, ref_order = ids.long().cpu().sort(dim=1), ref_ids.long().sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.cpu().gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        runtime.check_device(torch.zeros(1))
