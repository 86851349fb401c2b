"""Which routed experts a rank holds: the expert-parallel placement of every MoE layer.

Created by the data-parallel rank (``deepinfer.parallel.rank``) before the model is built, from the
engine configuration and the model configuration; read by the model (each ``MoE`` keeps its layer's
slots), the loader (a rank reads only the expert tensors its slots hold) and the live rearrangement,
which replaces a layer's row. Host data only.

Each MoE layer has ``num_slots = n_routed_experts + num_redundant_experts`` physical slots; rank r holds
slots ``[r * S, (r + 1) * S)`` with ``S = num_slots / world`` (the contiguous layout ``ep_dispatch``
assumes), and ``phy2log[layer][slot]`` names the logical expert in each slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deepinfer.config import EngineConfig
from deepinfer.model.config import ModelConfig
from deepinfer.parallel.eplb import rebalance_experts


def moe_layers(config: ModelConfig) -> list[int]:
    """Indices of the MoE layers (main layers, then MTP layers numbered after them)."""
    total = config.num_hidden_layers + config.num_nextn_predict_layers
    return [layer for layer in range(total) if config.is_moe_layer(layer)]


def check_expert_parallel(model: ModelConfig, engine: EngineConfig) -> None:
    """Raise a one-line ValueError naming the option when the experts cannot be sharded as configured."""
    if not engine.enable_expert_parallel:
        return
    experts, dp, extra = model.n_routed_experts or 0, engine.data_parallel_size, engine.num_redundant_experts
    if not experts:
        raise ValueError("enable_expert_parallel needs a MoE model; this one has no routed experts")
    if dp > experts:
        raise ValueError(
            f"data_parallel_size={dp} exceeds the model's {experts} routed experts: with "
            "enable_expert_parallel every rank needs at least one expert"
        )
    if (experts + extra) % dp:
        need = -(experts + extra) % dp
        raise ValueError(
            f"{experts} routed experts + num_redundant_experts={extra} do not divide over "
            f"data_parallel_size={dp}; raise num_redundant_experts by {need} (to {extra + need})"
        )


@dataclass(slots=True)
class ExpertShard:
    """One rank's view of the expert placement (see the module docstring)."""

    rank: int
    world: int
    group: Any | None  # the torch.distributed group ep_dispatch/ep_combine run over
    num_experts: int
    num_slots: int
    layers: list[int]  # MoE layer indices, the rows of phy2log
    phy2log: Tensor  # [len(layers), num_slots] int64

    @classmethod
    def initial(cls, model: ModelConfig, engine: EngineConfig, rank: int, group: Any | None) -> ExpertShard:
        """The placement before any load is seen: identity, or (with redundant slots) DeepSeek's policy
        on a uniform load, which replicates experts in index order and spreads the replicas."""
        check_expert_parallel(model, engine)
        experts = model.n_routed_experts or 0
        slots = experts + engine.num_redundant_experts
        layers = moe_layers(model)
        world = engine.data_parallel_size
        if slots == experts:
            phy2log = torch.arange(experts).expand(len(layers), -1).clone()
        else:
            uniform = torch.ones(len(layers), experts)
            phy2log, _, _ = rebalance_experts(uniform, slots, 1, 1, world)
        return cls(rank, world, group, experts, slots, layers, phy2log)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.world

    def row(self, layer: int) -> int:
        return self.layers.index(layer)

    def local_experts(self, layer: int) -> list[int]:
        """The logical expert in each of this rank's slots of ``layer``."""
        s = self.slots_per_rank
        return self.phy2log[self.row(layer), self.rank * s : (self.rank + 1) * s].tolist()

    def log2phy(self, layer: int) -> tuple[Tensor, Tensor]:
        """(log2phy [E, max replicas] int64 padded with -1, logcnt [E] int64) of ``layer``."""
        phy2log = self.phy2log[self.row(layer)]
        logcnt = torch.bincount(phy2log, minlength=self.num_experts)
        table = torch.full((self.num_experts, int(logcnt.max())), -1, dtype=torch.int64)
        seen = [0] * self.num_experts
        for slot, e in enumerate(phy2log.tolist()):
            table[e, seen[e]] = slot
            seen[e] += 1
        return table, logcnt


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of routed-expert weights the model holds (every ``mlp.experts`` parameter)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
