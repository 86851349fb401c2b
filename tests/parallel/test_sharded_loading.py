"""Sharded loading: a rank reads and holds only its experts (plus replicas); FP8 experts are
dequantised per rank. Loading needs no process group, so the ranks are built in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader import Checkpoint, load_model
from deepinfer.model_zoo import default_model_path
from deepinfer.parallel.placement import ExpertShard, expert_weight_bytes
from tests.model.hf_models import make_hf_checkpoint, rewrite_deepseek_layout


def shard_for(path: Path, rank: int, world: int, redundant: int = 0) -> ExpertShard:
    engine = EngineConfig(
        model=str(path),
        data_parallel_size=world,
        enable_expert_parallel=True,
        num_redundant_experts=redundant,
    )
    return ExpertShard.initial(ModelConfig.from_dict(Checkpoint.open(path).raw_config), engine, rank, None)


def check_slots_hold_their_experts(full, part, shard: ExpertShard) -> None:
    for layer in [x for x in shard.layers if x < len(part.layers)]:
        mine, theirs = part.layers[layer].mlp.experts, full.layers[layer].mlp.experts
        for slot, expert in enumerate(shard.local_experts(layer)):
            assert torch.equal(mine.w13[slot], theirs.w13[expert]) and torch.equal(
                mine.w2[slot], theirs.w2[expert]
            )


@pytest.mark.parametrize("redundant", [0, 4])
def test_bundled_model_two_ranks_each_hold_half_the_experts_plus_replicas(redundant: int) -> None:
    """Measured: each rank's expert weight bytes = single-process bytes * (slots per rank / experts);
    with no redundancy exactly half. Non-expert weights are replicated and identical."""
    path = default_model_path()
    full, _ = load_model(path, torch.float32)
    full_bytes = expert_weight_bytes(full)
    experts = full.config.n_routed_experts
    for rank in range(2):
        shard = shard_for(path, rank, 2, redundant)
        part, _ = load_model(path, torch.float32, shard=shard)
        per_rank = (experts + redundant) // 2
        assert expert_weight_bytes(part) == full_bytes * per_rank // experts
        if redundant == 0:
            assert expert_weight_bytes(part) * 2 == full_bytes
        check_slots_hold_their_experts(full, part, shard)
        # The fused-layout checkpoint is read as slices: fewer bytes than the whole file.
        assert part.load_stats.bytes_read < full.load_stats.bytes_read
        other = {n: p for n, p in part.named_parameters() if ".mlp.experts." not in n}
        ref = dict(full.named_parameters())
        assert all(torch.equal(p, ref[n]) for n, p in other.items())


def test_published_fp8_layout_rank_reads_only_its_experts(tmp_path: Path) -> None:
    """DeepSeek's per-expert FP8 layout in 2 shards: a rank skips every tensor of the experts it does not
    hold (never opened, never dequantised) and its slots equal the single-process dequantised experts."""
    model = make_hf_checkpoint(tmp_path / "hf", n_routed_experts=8)
    rewrite_deepseek_layout(model, tmp_path / "hf", tmp_path / "fp8", fp8=True, shards=2, block=16)
    full, _ = load_model(tmp_path / "fp8", torch.float32)
    moe_layers = sum(1 for layer in full.layers if hasattr(layer.mlp, "experts"))
    for rank in range(2):
        shard = shard_for(tmp_path / "fp8", rank, 2)
        part, _ = load_model(tmp_path / "fp8", torch.float32, shard=shard)
        assert part.load_stats.tensors_skipped == moe_layers * 4 * 3  # 4 experts x gate/up/down per layer
        assert part.load_stats.tensors_read == full.load_stats.tensors_read - part.load_stats.tensors_skipped
        assert expert_weight_bytes(part) * 2 == expert_weight_bytes(full)
        check_slots_hold_their_experts(full, part, shard)
