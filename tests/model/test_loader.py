"""Checkpoint loading: DeepSeek's published layout, FP8 block scales, shards, MTP, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.config import UnsupportedConfigError
from deepinfer.model.loader import CheckpointError, load_model
from tests.model.hf_models import (
    add_mtp_weights,
    dequantized_copy,
    make_hf_checkpoint,
    rewrite_deepseek_layout,
    write_fused_layout,
)
from tests.model.stepping import prompt_logits, single_request

PROMPT = [3, 17, 99, 4, 250, 31, 8, 77, 5, 120, 64, 2, 9]


def engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32))


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("hf")
    return path, make_hf_checkpoint(path)


@pytest.fixture(scope="module")
def hf_dir(hf) -> Path:
    return hf[0]


def test_published_per_expert_layout_equals_fused_layout(hf, tmp_path: Path) -> None:
    path, model = hf
    rewrite_deepseek_layout(model, path, tmp_path / "ds", fp8=False, shards=3)
    write_fused_layout(model, path, tmp_path / "fused")
    names = json.loads((tmp_path / "ds" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    ds = prompt_logits(engine(tmp_path / "ds"), PROMPT)
    assert torch.equal(ds, prompt_logits(engine(tmp_path / "fused"), PROMPT))
    assert torch.equal(ds, prompt_logits(engine(path), PROMPT))


def test_fp8_block_scaled_checkpoint_matches_its_dequantised_reference(hf, tmp_path: Path) -> None:
    hf_dir, model = hf
    rewrite_deepseek_layout(model, hf_dir, tmp_path / "fp8", fp8=True, shards=2)
    shard = load_file(next((tmp_path / "fp8").glob("*.safetensors")))
    assert any(t.dtype == torch.float8_e4m3fn for t in shard.values())
    dequantized_copy(tmp_path / "fp8", tmp_path / "ref")
    ours = prompt_logits(engine(tmp_path / "fp8"), PROMPT)
    ref = prompt_logits(engine(tmp_path / "ref"), PROMPT)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # and FP8 really changed the weights (the comparison is not trivially with the original model)
    assert not torch.allclose(ours, prompt_logits(engine(hf_dir), PROMPT), atol=1e-6)


def test_mtp_layer_loads_and_matches_an_independent_implementation(tmp_path: Path) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf = make_hf_checkpoint(tmp_path / "hf")
    mtp = add_mtp_weights(hf, tmp_path / "hf", tmp_path / "mtp")
    eng = engine(tmp_path / "mtp")
    assert len(eng.model.mtp_layers) == 1 and eng.model.num_cache_layers == 4
    n = hf.config.num_hidden_layers
    ids = PROMPT

    # Independent: transformers' own decoder layer, norms and rotary embedding with the MTP weights.
    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=n).eval()
    prefix = f"model.layers.{n}."
    layer.load_state_dict({k.removeprefix(prefix): v for k, v in mtp.items() if k.startswith(prefix) and
                           k.split(".")[3] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})  # fmt: skip

    def norm(key: str) -> DeepseekV3RMSNorm:
        module = DeepseekV3RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps)
        module.weight.data.copy_(mtp[prefix + key])
        return module

    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
        x = F.linear(
            torch.cat((norm("enorm.weight")(F.embedding(torch.tensor(ids[1:]), mtp[prefix + "embed_tokens.weight"])),
                       norm("hnorm.weight")(hidden[:-1])), dim=-1),
            mtp[prefix + "eh_proj.weight"],
        )  # fmt: skip
        t = len(ids) - 1
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos,
                    position_embeddings=hf.model.rotary_emb(x[None], pos))[0]  # fmt: skip
        expected = F.linear(norm("shared_head.norm.weight")(out), mtp[prefix + "shared_head.head.weight"])

    # deepinfer: main model prefill, then the MTP module on (token i+1, hidden i).
    runner = eng.runner
    blocks = [0]
    main = runner.prepare([single_request(ids, blocks)])
    shifted = runner.prepare([single_request(ids[1:], blocks)])
    with torch.inference_mode():
        h = eng.model(main.input_ids, main.positions, main.meta, eng.kv_caches)
        _, logits = eng.model.mtp_forward(
            0, shifted.input_ids, shifted.positions, h[:-1], shifted.meta, eng.kv_caches
        )
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_missing_mtp_weights_load_without_mtp(hf_dir: Path, tmp_path: Path, caplog) -> None:
    shutil.copytree(hf_dir, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(tmp_path / "m", torch.float32)
    assert len(model.mtp_layers) == 0
    assert "no MTP weights" in caplog.text


# ---------------------------------------------------------------------------------------- errors


def edit(hf_dir: Path, tmp_path: Path, tensors=None, config=None) -> Path:
    dst = tmp_path / "edited"
    shutil.copytree(hf_dir, dst)
    if tensors is not None:
        data = load_file(dst / "model.safetensors")
        tensors(data)
        save_file(data, dst / "model.safetensors")
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_model(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_model(tmp_path, torch.float32)


def test_missing_tensor_is_named(hf_dir: Path, tmp_path: Path) -> None:
    path = edit(hf_dir, tmp_path, tensors=lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensors for: model\.layers\.2\.self_attn\.kv_b_proj\.weight"
    ):
        load_model(path, torch.float32)


def test_missing_expert_is_named(hf, tmp_path: Path) -> None:
    rewrite_deepseek_layout(hf[1], hf[0], tmp_path / "ds", fp8=False, shards=1)
    shard = next((tmp_path / "ds").glob("*.safetensors"))
    data = load_file(shard)
    del data["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(data, shard)
    index = tmp_path / "ds" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    del weight_map["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    index.write_text(json.dumps(weight_map))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.\{e\}\.gate_proj/up_proj"):
        load_model(tmp_path / "ds", torch.float32)


def test_unexpected_tensor_is_named(hf_dir: Path, tmp_path: Path) -> None:
    def add(t):
        t["model.layers.0.self_attn.rotary_extra.weight"] = torch.zeros(3)

    with pytest.raises(
        CheckpointError, match=r"does not use: model\.layers\.0\.self_attn\.rotary_extra\.weight"
    ):
        load_model(edit(hf_dir, tmp_path, tensors=add), torch.float32)


def test_misshaped_tensor_is_named(hf_dir: Path, tmp_path: Path) -> None:
    def shrink(t):
        t["model.layers.1.self_attn.o_proj.weight"] = t["model.layers.1.self_attn.o_proj.weight"][
            :, :-1
        ].clone()

    with pytest.raises(
        CheckpointError, match=r"o_proj\.weight has shape \(64, 95\), but the model expects \(64, 96\)"
    ):
        load_model(edit(hf_dir, tmp_path, tensors=shrink), torch.float32)


def test_fp8_weight_without_scale_is_named(hf, tmp_path: Path) -> None:
    rewrite_deepseek_layout(hf[1], hf[0], tmp_path / "fp8", fp8=True, shards=1)
    index = tmp_path / "fp8" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    del weight_map["weight_map"]["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    index.write_text(json.dumps(weight_map))
    with pytest.raises(
        CheckpointError, match=r"o_proj\.weight is float8_e4m3fn but .*weight_scale_inv is missing"
    ):
        load_model(tmp_path / "fp8", torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c.update(model_type="llama"),
            "model_type='llama' is not supported; supported: deepseek_v3, deepseek_v2",
        ),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported; supported: 'silu'"),
        (
            lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
            "rope type 'longrope'",
        ),
        (
            lambda c: c.update(quantization_config={"quant_method": "awq"}),
            "quant_method='awq' is not supported",
        ),
        (lambda c: c.update(n_group=3), "not divisible by n_group=3"),
    ],
)
def test_unsupported_config_values_are_named(hf_dir: Path, tmp_path: Path, change, message: str) -> None:
    with pytest.raises(UnsupportedConfigError) as err:
        load_model(edit(hf_dir, tmp_path, config=change), torch.float32)
    assert message in str(err.value)


def test_a_truncated_safetensors_file_is_an_error_naming_it(hf_dir: Path, tmp_path: Path) -> None:
    """A shard cut short (a download or copy that stopped) is a CheckpointError naming the file, never a
    raw safetensors exception; a shard whose header is whole but whose data is cut short too."""
    for keep in (100, None):  # inside the header; the header whole and the data cut
        folder = tmp_path / f"cut-{keep}"
        shutil.copytree(hf_dir, folder)
        shard = sorted(folder.glob("*.safetensors"))[0]
        data = shard.read_bytes()
        header = 8 + int.from_bytes(data[:8], "little")
        shard.write_bytes(data[: keep if keep is not None else header + 16])
        with pytest.raises(CheckpointError, match=rf"{shard.name} is not a readable safetensors file"):
            load_model(folder, torch.float32)
