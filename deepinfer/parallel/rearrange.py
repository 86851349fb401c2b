"""Live expert rearrangement: move expert weights between ranks to an EPLB placement while serving.

Called by the data-parallel rank between two lockstep steps, on every rank at the same step (the step
count is agreed through the lockstep header). ``plan`` is a pure function of the all-reduced load, so
every rank takes the same decision; ``apply`` moves the weights with point-to-point sends over the
expert-parallel group, layer by layer (one layer's new weights are the only extra memory), then swaps
each layer's weights and replica table. Requests in flight are untouched (their KV cache does not
depend on the placement) and a replica is an exact copy, so outputs do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from deepinfer.model.moe import MoE
from deepinfer.parallel.eplb import balancedness, rebalance_experts
from deepinfer.parallel.placement import ExpertShard


@dataclass(slots=True)
class Decision:
    """A planned rearrangement: predicted balance (mean/max rank load, over the window's load) before and
    after, expert bytes that would cross ranks, and whether the gain pays for them."""

    balance_before: float
    balance_after: float
    bytes_moved: int
    apply: bool
    phy2log: Tensor  # [layers, slots] the new placement


def _logcnt(phy2log: Tensor, num_experts: int) -> Tensor:
    return torch.stack([torch.bincount(row, minlength=num_experts) for row in phy2log])


def _transfers(old: list[int], new: list[int], per_rank: int) -> list[tuple[int, int, int, int]]:
    """(source rank, source local slot, destination rank, destination local slot) of every slot whose
    expert changes and that no slot of its own rank already holds; the source is the first old slot
    holding the expert (the same choice on every rank)."""
    moves = []
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        dst = slot // per_rank
        if expert in old[dst * per_rank : (dst + 1) * per_rank]:
            continue  # a local copy
        src_slot = old.index(expert)
        moves.append((src_slot // per_rank, src_slot % per_rank, dst, slot % per_rank))
    return moves


def plan(
    load: Tensor,
    shard: ExpertShard,
    num_groups: int,
    num_nodes: int,
    bytes_per_slot: int,
    min_gain: float,
    gain_per_gib: float,
) -> Decision:
    """Decide on a new placement for ``load`` [layers, experts] (tokens per logical expert, summed over
    the ranks): apply it when ``after - before > min_gain + gain_per_gib * GiB moved``."""
    world = shard.world
    groups = num_groups if shard.num_experts % num_groups == 0 else 1
    phy2log, _, logcnt = rebalance_experts(load, shard.num_slots, groups, num_nodes, world)
    before = balancedness(load, shard.phy2log, _logcnt(shard.phy2log, shard.num_experts), world)
    after = balancedness(load, phy2log, logcnt, world)
    moved = sum(
        len(_transfers(old.tolist(), new.tolist(), shard.slots_per_rank))
        for old, new in zip(shard.phy2log, phy2log)
    )
    cost = moved * bytes_per_slot
    apply = after - before > min_gain + gain_per_gib * cost / 2**30
    return Decision(before, after, cost, apply, phy2log)


def apply(moes: dict[int, MoE], shard: ExpertShard, phy2log: Tensor) -> None:
    """Move every layer's expert weights to ``phy2log`` [layers, slots] (collective over shard.group)."""
    s, me = shard.slots_per_rank, shard.rank
    for row, layer in enumerate(shard.layers):
        moe = moes.get(layer)
        old, new = shard.phy2log[row].tolist(), phy2log[row].tolist()
        if old == new:
            continue
        if moe is None:  # a layer this model does not hold (no MTP weights): placement only
            shard.phy2log[row] = phy2log[row]
            continue
        weights = moe.experts.slot_tensors()  # w13, w2 and, when quantised, their scales
        fresh = [w.data.clone() for w in weights]
        pending = []
        for src, src_slot, dst, dst_slot in _transfers(old, new, s):
            tag = (row * shard.num_slots + dst * s + dst_slot) * len(weights)
            for k, w in enumerate(weights):
                if src == me:
                    # as bytes: exact for every dtype, FP8 included (which collectives may not know)
                    payload = w.data[src_slot].contiguous().view(torch.uint8)
                    pending.append(dist.isend(payload, dst, shard.group, tag + k))
                if dst == me:
                    pending.append(
                        dist.irecv(fresh[k][dst_slot].view(torch.uint8), src, shard.group, tag + k)
                    )
        mine = old[me * s : (me + 1) * s]
        for local in range(s):
            expert = new[me * s + local]
            if mine[local] != expert and expert in mine:
                for k, w in enumerate(weights):
                    fresh[k][local].copy_(w.data[mine.index(expert)])
        for work in pending:
            work.wait()
        for w, f in zip(weights, fresh):
            w.data = f
        shard.phy2log[row] = phy2log[row]
        moe.set_placement(*shard.log2phy(layer))
