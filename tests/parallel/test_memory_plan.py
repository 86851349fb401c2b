"""``deepinfer plan memory`` on DeepSeek-V3's published config (tests/parallel/fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.cli import main
from deepinfer.parallel.memory_plan import load_config, plan_memory

V3 = Path(__file__).with_name("fixtures") / "deepseek_v3_config.json"


def test_v3_weights_match_the_published_size() -> None:
    """685 B parameters (671 B + 14 B MTP); the FP8 checkpoint is about 688 GB."""
    config = load_config(V3)
    bf16 = plan_memory(config, 1, "bf16")
    assert 684e9 < bf16.weight_bytes / 2 < 686e9
    assert 680e9 < plan_memory(config, 1, "fp8").weight_bytes < 695e9


@pytest.mark.parametrize("ep", [8, 16, 32, 64])
def test_experts_divide_over_ranks_and_the_rest_is_replicated(ep: int) -> None:
    config = load_config(V3)
    one, plan = plan_memory(config, 1), plan_memory(config, ep)
    assert plan.expert_weight_bytes * ep == one.expert_weight_bytes
    assert plan.replicated_weight_bytes == one.replicated_weight_bytes
    assert plan.experts_per_rank == 256 // ep
    sm90 = next(f for f in plan.chips if f.chip == "sm90")
    assert sm90.kv_tokens == max(0, sm90.free_for_kv_bytes) // plan.kv_bytes_per_token
    assert plan.kv_bytes_per_token == (512 + 64) * 2 * 62  # latent + rope, bf16, 61 layers + MTP


def test_redundant_slots_add_expert_memory() -> None:
    config = load_config(V3)
    base, extra = plan_memory(config, 32), plan_memory(config, 32, num_redundant_experts=32)
    assert extra.experts_per_rank == 9
    assert extra.expert_weight_bytes * 8 == base.expert_weight_bytes * 9
    with pytest.raises(ValueError, match="do not divide over ep=32"):
        plan_memory(config, 32, num_redundant_experts=3)


def test_cli_prints_every_ep_size_and_chip(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEEPINFER_MALLOC_TUNING", "0")  # main() would re-exec this process otherwise
    assert main(["plan", "memory", "--model", str(V3)]) == 0
    out = capsys.readouterr().out
    for ep in (8, 16, 32, 64):
        assert f"EP {ep} (fp8" in out
    assert "sm90" in out and "ascend950dt" in out and "does not fit" in out  # EP 8 on a 64 GB 910B
    assert main(["plan", "memory", "--model", str(V3), "--ep", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["ep"] == 16 and rows[0]["experts_per_rank"] == 16
