"""Expert-parallel load balancing (EPLB): where to place each MoE layer's experts and their replicas.

A pure function of the observed load, with DeepSeek's interface and policies so that operators can
compare placements with theirs (``rebalance_experts``):

- **hierarchical** (used when the expert groups divide evenly over the nodes): whole expert groups are
  packed onto nodes so that every node carries about the same load (routing is group-limited, so this
  keeps a token's experts on few nodes); inside each node, redundant replicas go one at a time to the
  expert with the highest load per replica; then the node's physical experts are packed onto its GPUs,
  the same number on each, balancing load.
- **global** (otherwise, or asked for with one group and one node): replicas over all experts, then
  packing onto all GPUs, ignoring groups.

Packing is greedy longest-load-first: items in descending load (ties by index), each to the lightest
pack that still has room. A physical expert's load is its logical expert's load divided by the
expert's replica count (tokens are spread evenly over replicas).

Who calls it: the engine's live rearrangement (``deepinfer.parallel.expert_load``), the simulator and
the memory planner. Inputs and outputs are host tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _pack(load: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Balanced packing of ``len(load)`` items into ``num_packs`` packs of equal item count.

    Returns (pack of each item, position of the item inside its pack)."""
    capacity = len(load) // num_packs
    pack_of, slot_of = [0] * len(load), [0] * len(load)
    totals, counts = [0.0] * num_packs, [0] * num_packs
    for item in sorted(range(len(load)), key=lambda i: -load[i]):
        pack = min((p for p in range(num_packs) if counts[p] < capacity), key=lambda p: totals[p])
        pack_of[item], slot_of[item] = pack, counts[pack]
        totals[pack] += load[item]
        counts[pack] += 1
    return pack_of, slot_of


def _replicate(load: list[float], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Give ``len(load)`` experts ``num_slots`` physical slots: one each, then every extra slot to the
    expert with the highest load per replica (lowest index on ties).

    Returns (expert of each slot, replica index of each slot, replica count of each expert)."""
    count = [1] * len(load)
    expert_of, replica_of = list(range(len(load))), [0] * len(load)
    for _ in range(num_slots - len(load)):
        best = max(range(len(load)), key=lambda e: (load[e] / count[e], -e))
        expert_of.append(best)
        replica_of.append(count[best])
        count[best] += 1
    return expert_of, replica_of, count


def _place_layer(
    load: list[float], num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[list[int], list[int], list[int]]:
    """One layer's hierarchical placement: (logical expert of each physical slot, its replica index,
    replica count of each logical expert). Slots are numbered GPU by GPU."""
    num_experts = len(load)
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus

    # 1. Expert groups onto nodes; node n's experts are renumbered n * experts_per_node + ...
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group, slot_of_group = _pack(group_load, num_nodes)
    node_experts: list[list[int]] = [[0] * experts_per_node for _ in range(num_nodes)]
    for g in range(num_groups):
        base = slot_of_group[g] * group_size
        for k in range(group_size):
            node_experts[node_of_group[g]][base + k] = g * group_size + k

    phy2log = [0] * num_slots
    phy_rank = [0] * num_slots
    count = [0] * num_experts
    for node in range(num_nodes):
        experts = node_experts[node]
        # 2. Replicas inside the node.
        expert_of, replica_of, node_count = _replicate([load[e] for e in experts], slots_per_node)
        for local, e in enumerate(experts):
            count[e] = node_count[local]
        # 3. The node's physical experts onto its GPUs.
        phy_load = [load[experts[x]] / node_count[x] for x in expert_of]
        gpu_of, slot_in_gpu = _pack(phy_load, gpus_per_node)
        for p in range(slots_per_node):
            slot = node * slots_per_node + gpu_of[p] * slots_per_gpu + slot_in_gpu[p]
            phy2log[slot] = experts[expert_of[p]]
            phy_rank[slot] = replica_of[p]
    return phy2log, phy_rank, count


def check_placement_sizes(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise ValueError (naming the argument) when the sizes admit no placement with equal slot counts."""
    if num_gpus < 1 or num_nodes < 1 or num_groups < 1:
        raise ValueError(
            f"num_gpus, num_nodes and num_groups must be >= 1, got {num_gpus}, {num_nodes}, {num_groups}"
        )
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_experts} logical experts")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} does not divide evenly over num_gpus={num_gpus}")
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into num_groups={num_groups} equal groups")


def rebalance_experts(
    weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """A placement of every layer's logical experts onto ``num_replicas`` physical slots.

    weight: [L, E] load of each logical expert (tokens routed to it; any real dtype).
    num_replicas: physical slots per layer, E plus the redundant ones, divisible by ``num_gpus``.
    num_groups: expert groups (the model's ``n_group``); num_nodes: hosts; num_gpus: ranks in all.
    The hierarchical policy runs when the groups and the GPUs divide evenly over the nodes; otherwise
    the global one (one group, one node), as in DeepSeek's EPLB.

    Returns, all int64:
      phy2log [L, num_replicas]: the logical expert in each physical slot; slots
        ``[r * num_replicas / num_gpus, (r + 1) * num_replicas / num_gpus)`` belong to rank r;
      log2phy [L, E, num_replicas - E + 1]: the physical slots of each logical expert, replica by
        replica, padded with -1;
      logcnt [L, E]: replicas per logical expert (>= 1).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    num_layers, num_experts = weight.shape
    check_placement_sizes(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    hierarchical = num_groups % num_nodes == 0 and num_gpus % num_nodes == 0
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    loads = weight.detach().to("cpu", torch.float64).tolist()
    max_replicas = num_replicas - num_experts + 1
    phy2log = torch.empty(num_layers, num_replicas, dtype=torch.int64)
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    logcnt = torch.empty(num_layers, num_experts, dtype=torch.int64)
    for layer, load in enumerate(loads):
        p2l, rank, count = _place_layer(load, num_replicas, groups, nodes, num_gpus)
        phy2log[layer] = torch.tensor(p2l)
        logcnt[layer] = torch.tensor(count)
        for slot, (e, r) in enumerate(zip(p2l, rank)):
            log2phy[layer, e, r] = slot
    return phy2log, log2phy, logcnt


def identity_placement(num_layers: int, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert e in slot e, one replica each (no redundancy): the placement before any load is seen."""
    phy2log = torch.arange(num_experts).expand(num_layers, -1).clone()
    return phy2log, phy2log[:, :, None].clone(), torch.ones(num_layers, num_experts, dtype=torch.int64)


def rank_loads(weight: Tensor, phy2log: Tensor, logcnt: Tensor, num_gpus: int) -> Tensor:
    """[L, num_gpus] load each rank would carry: each slot gets its expert's load / replica count."""
    per_slot = weight.double().gather(1, phy2log) / logcnt.double().gather(1, phy2log)
    return per_slot.view(weight.shape[0], num_gpus, -1).sum(-1)


def balancedness(weight: Tensor, phy2log: Tensor, logcnt: Tensor, num_gpus: int) -> float:
    """Mean over max of per-rank load, averaged over layers (1.0 = perfectly balanced). Layers with no
    load count as balanced."""
    loads = rank_loads(weight, phy2log, logcnt, num_gpus)
    peak = loads.max(-1).values
    ratio = torch.where(peak > 0, loads.mean(-1) / peak.clamp_min(1e-30), torch.ones_like(peak))
    return float(ratio.mean())
