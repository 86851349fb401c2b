"""``deepinfer plan memory`` on DeepSeek-V3's published config (tests/parallel/fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.cli import main
from deepinfer.model.config import ModelConfig
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


FP8_MODEL = Path(__file__).resolve().parents[2] / "deepinfer" / "models" / "deepinfer-tiny-coder-fp8"


def test_as_stored_counts_the_checkpoints_stored_bytes() -> None:
    """The bundled FP8 model: its plan is the bytes its safetensors store (FP8 values, float32 block
    scales, bf16 rest), except the router gate, which the model holds in float32 (4 bytes, not 2)."""
    from safetensors import safe_open

    stored = gates = 0
    with safe_open(FP8_MODEL / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            stored += t.numel() * t.element_size()
            gates += t.numel() * 2 if name.endswith("mlp.gate.weight") else 0
    plan = plan_memory(load_config(FP8_MODEL), 1)
    assert plan.weight_format == "as-stored" and plan.formats == "fp8 32x32 ue8m0, rest bf16"
    assert plan.weight_bytes == stored + gates
    fp32 = plan_memory(load_config(FP8_MODEL), 1, "fp32")
    assert fp32.formats == "all fp32" and plan.weight_bytes < 0.45 * fp32.weight_bytes


def test_mxfp4_experts_take_their_stored_bytes() -> None:
    """V4-style experts (expert_dtype fp4) on V3: half a byte per value plus one e8m0 byte per 32,
    exactly, per expert matrix; the dense weights stay FP8 with their 128x128 float32 scales."""
    raw = json.loads(V3.read_text())
    raw["quantization_config"]["expert_dtype"] = "fp4"
    fp4 = plan_memory(ModelConfig.from_dict(raw), 8)
    fp8 = plan_memory(load_config(V3), 8)
    assert fp4.formats == "fp8 128x128 f32 (experts mxfp4), rest bf16"
    assert fp4.replicated_weight_bytes == fp8.replicated_weight_bytes
    i, d = 2048, 7168  # moe_intermediate_size, hidden_size
    per_expert_fp8 = 2 * (i * d + 16 * 56 * 4) + (d * i + 56 * 16 * 4)  # gate, up; down
    per_expert_fp4 = 3 * (i * d // 2 + i * d // 32)
    slots = (58 + 1) * 256 // 8  # 58 MoE layers and the MTP layer's, 256 experts over 8 ranks
    assert fp8.expert_weight_bytes == slots * per_expert_fp8
    assert fp4.expert_weight_bytes == slots * per_expert_fp4
    assert fp4.expert_weight_bytes < 0.54 * fp8.expert_weight_bytes


def test_a_bf16_checkpoint_as_stored_is_bf16_and_fp8_plans_deepseeks_format() -> None:
    raw = json.loads(V3.read_text())
    del raw["quantization_config"]
    config = ModelConfig.from_dict(raw)
    assert plan_memory(config, 8).formats == "all bf16"
    assert plan_memory(config, 8).weight_bytes == plan_memory(load_config(V3), 8, "bf16").weight_bytes
    assert plan_memory(config, 8, "fp8").weight_bytes == plan_memory(load_config(V3), 8).weight_bytes
    with pytest.raises(ValueError, match="weights must be one of as-stored, fp8, bf16, fp32"):
        plan_memory(config, 8, "int4")  # type: ignore[arg-type]


def test_cli_plans_the_stored_format_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEEPINFER_MALLOC_TUNING", "0")
    assert main(["plan", "memory", "--model", "deepinfer-tiny-coder-fp8", "--ep", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["weight_format"] == "as-stored" and row["formats"] == "fp8 32x32 ue8m0, rest bf16"
    assert main(["plan", "memory", "--model", str(V3), "--ep", "8", "--weights", "bf16"]) == 0
    assert "EP 8 (all bf16" in capsys.readouterr().out
