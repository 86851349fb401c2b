"""Live rearrangement's pure parts: the load window, the transfer list and the gain-vs-bytes decision."""

from __future__ import annotations

import torch

from deepinfer.parallel.expert_load import ExpertLoadRecorder
from deepinfer.parallel.placement import ExpertShard
from deepinfer.parallel.rearrange import _transfers, plan


def test_window_keeps_only_the_last_steps() -> None:
    rec = ExpertLoadRecorder([1, 2], num_experts=4, window=2)
    for step in range(3):
        rec.record(1, torch.tensor([[step, step]]))
        rec.record_received(2, 5 + step)
        rec.advance()
    load = rec.window_load()
    assert load[0].tolist() == [0, 2, 2, 0]  # steps 1 and 2; step 0 fell out
    assert load[1].sum() == 0 and rec.last_received() == 7 and rec.steps == 3


def test_transfers_move_only_what_no_local_slot_holds() -> None:
    # 2 ranks x 2 slots: rank 0 [0, 1], rank 1 [2, 3] -> rank 0 [0, 2], rank 1 [1, 1]
    moves = _transfers([0, 1, 2, 3], [0, 2, 1, 1], per_rank=2)
    assert moves == [(1, 0, 0, 1), (0, 1, 1, 0), (0, 1, 1, 1)]
    assert _transfers([0, 1, 2, 3], [1, 0, 3, 2], per_rank=2) == []  # swaps inside a rank are local


def shard() -> ExpertShard:
    return ExpertShard(0, 2, None, 8, 8, [1], torch.arange(8)[None].clone())


def test_decision_weighs_gain_against_bytes() -> None:
    skewed = torch.tensor([[50.0, 40, 30, 20, 1, 1, 1, 1]])  # identity puts the hot half on rank 0
    d = plan(skewed, shard(), 4, 1, bytes_per_slot=1 << 20, min_gain=0.05, gain_per_gib=0.0)
    assert d.apply and d.balance_after > 0.95 > 0.6 > d.balance_before and d.bytes_moved > 0
    assert not plan(skewed, shard(), 4, 1, bytes_per_slot=1 << 30, min_gain=0.05, gain_per_gib=1.0).apply
    flat = torch.ones(1, 8)
    assert not plan(flat, shard(), 4, 1, bytes_per_slot=1, min_gain=0.05, gain_per_gib=0.0).apply
