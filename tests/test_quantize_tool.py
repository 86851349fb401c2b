"""tools/quantize_fp8.py: what it quantises (DeepSeek's choice of tensors), how (block scales whose
error bound holds per element), that its output is a valid DeepSeek FP8 checkpoint the config parser
reads, that it is deterministic, its errors, and that the bundled deepinfer-tiny-coder-fp8 is exactly
what the tool writes from the bundled float32 model."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.backends.quant import FP8_DTYPE, expand_scale
from deepinfer.model.config import ModelConfig
from deepinfer.model.layouts import to_published_layout
from deepinfer.model_zoo import PACKAGED_MODELS, packaged_models, resolve_model
from tests.conftest import REPO_ROOT
from tests.model.hf_models import add_mtp_weights, make_hf_checkpoint

_spec = importlib.util.spec_from_file_location("quantize_fp8", REPO_ROOT / "tools" / "quantize_fp8.py")
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

FP32 = PACKAGED_MODELS / "deepinfer-tiny-coder"
FP8 = PACKAGED_MODELS / "deepinfer-tiny-coder-fp8"
# The tensors DeepSeek-V3's published index gives a weight_scale_inv, in our random checkpoint's names.
EXPECTED_FP8 = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random V3 checkpoint (hidden 64, widths 96/32/48: none a multiple of a 32 or 128 block in
    every dimension) in transformers 5's fused expert layout, with one MTP layer."""
    base = tmp_path_factory.mktemp("hf")
    model = make_hf_checkpoint(base, seed=3, num_nextn_predict_layers=1)
    dst = tmp_path_factory.mktemp("with_mtp")
    add_mtp_weights(model, base, dst)
    return dst


def _run(src: Path, out: Path, *options: str) -> int:
    return tool.main(["--src", str(src), "--out", str(out), *options])


def test_quantises_exactly_deepseeks_linear_weights_with_bounded_error(source: Path, tmp_path: Path) -> None:
    assert _run(source, tmp_path, "--block", "32", "32") == 0
    src = to_published_layout(load_file(source / "model.safetensors"))
    out = load_file(tmp_path / "model.safetensors")
    fp8 = {n for n, t in out.items() if t.dtype == FP8_DTYPE}
    assert fp8 == {n for n in src if EXPECTED_FP8.fullmatch(n)}
    assert any(".mlp.experts.7." in n for n in fp8) and any("layers.3.self_attn" in n for n in fp8)  # MTP
    assert {n for n in out if n.endswith("weight_scale_inv")} == {
        n.removesuffix("weight") + "weight_scale_inv" for n in fp8
    }
    for name in fp8:
        w, values = src[name].float(), out[name]
        scale = out[name.removesuffix("weight") + "weight_scale_inv"]
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == (math.ceil(w.shape[0] / 32), math.ceil(w.shape[1] / 32)), name
        expanded = expand_scale(scale, (32, 32), *w.shape)
        # e4m3 rounds to nearest: at most half a step, 16 at the top of the +-448 range, per element.
        assert ((values.float() * expanded - w).abs() <= 16 * expanded + 1e-12).all(), name
        assert values.float().abs().amax() == 448.0, name  # each block's maximum maps to 448
    kept = set(src) - fp8
    assert {n for n in kept if "eh_proj" in n or "shared_head.head" in n or "mlp.gate.weight" in n}
    for name in kept:
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert out[name].dtype == want, name
        assert torch.equal(out[name], src[name].to(want)), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [32, 32]
    }  # fmt: skip
    assert config["dtype"] == "bfloat16"
    parsed = ModelConfig.from_dict(config)
    assert parsed.weight_format is not None and parsed.weight_format.block == (32, 32)
    report = json.loads((tmp_path / "quantization.json").read_text())
    assert report["quantised_tensors"] == len(fp8) and report["kept_tensors"] == len(kept)
    assert report["max_abs_error_over_absmax"] <= 16 / 448 + 1e-6


def test_ue8m0_scales_are_powers_of_two_and_the_output_is_deterministic(source: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert _run(source, out, "--scale-fmt", "ue8m0", "--keep-dtype", "float32") == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    out = load_file(a / "model.safetensors")
    scales = torch.cat([t.flatten() for n, t in out.items() if n.endswith("weight_scale_inv")])
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()  # 2**e exactly
    assert json.loads((a / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    assert out["model.embed_tokens.weight"].dtype == torch.float32


def test_refuses_a_quantised_source_and_bad_options(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(FP8, tmp_path / "x") == 2
    assert "already quantised" in capsys.readouterr().err
    assert _run(source, tmp_path / "y", "--block", "0", "128") == 2
    assert "block must be two positive integers" in capsys.readouterr().err
    assert _run(tmp_path / "missing", tmp_path / "z") == 2
    assert "no config.json" in capsys.readouterr().err
    assert _run(source, source) == 2
    assert "is the source folder" in capsys.readouterr().err


def test_the_bundled_fp8_model_is_what_the_tool_writes(tmp_path: Path) -> None:
    """The README's command, re-run: identical weights, config and report; the README differs only
    in the output folder it names."""
    readme = (FP8 / "README.md").read_text()
    command = next(
        line for line in readme.splitlines() if line.startswith(".venv/bin/python tools/quantize_fp8.py")
    )
    argv = command.split()[2:]
    out_at = argv.index("--out") + 1
    shipped_out = argv[out_at]
    argv[out_at] = str(tmp_path / "deepinfer-tiny-coder-fp8")
    argv = [str(REPO_ROOT / a) if a.startswith(("deepinfer/", "bench/")) and i != out_at else a
            for i, a in enumerate(argv)]  # fmt: skip
    assert tool.main(argv) == 0
    rebuilt = tmp_path / "deepinfer-tiny-coder-fp8"
    for name in ("model.safetensors", "config.json", "quantization.json", "tokenizer.json"):
        assert (rebuilt / name).read_bytes() == (FP8 / name).read_bytes(), name
    assert (rebuilt / "confidence_head" / "model.safetensors").read_bytes() == (
        FP32 / "confidence_head" / "model.safetensors"
    ).read_bytes()
    rebuilt_readme = (rebuilt / "README.md").read_text().replace(argv[out_at], shipped_out)
    for i, a in enumerate(command.split()[2:]):
        if a.startswith(("deepinfer/", "bench/")) and i != out_at:
            rebuilt_readme = rebuilt_readme.replace(str(REPO_ROOT / a), a)
    assert rebuilt_readme == readme


def test_the_bundled_models_are_selected_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert packaged_models() == ["deepinfer-tiny-coder", "deepinfer-tiny-coder-fp8"]
    assert resolve_model("deepinfer-tiny-coder-fp8") == FP8
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "deepinfer-tiny-coder-fp8"
    shutil.copytree(FP8 / "confidence_head", local)  # a local folder of that name wins: it is a path
    assert resolve_model("deepinfer-tiny-coder-fp8") == Path("deepinfer-tiny-coder-fp8")
    assert resolve_model("no/such/folder") == Path("no/such/folder")


def test_every_model_option_takes_a_bundled_name() -> None:
    """deepinfer run / bench, deepinfer serve, the router and the torchrun launcher."""
    import argparse

    from deepinfer.cli import add_bench_arguments, add_run_arguments
    from deepinfer.parallel.launch import parse_args as launch_args
    from deepinfer.router.cli import add_router_arguments
    from deepinfer.server.launch import add_serve_arguments

    for add in (add_run_arguments, add_serve_arguments, add_router_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args(["--model", "deepinfer-tiny-coder-fp8"]).model == str(FP8), add.__name__
    bench = argparse.ArgumentParser()
    add_bench_arguments(bench)
    assert bench.parse_args(["offline", "--model", "deepinfer-tiny-coder-fp8"]).model == str(FP8)
    assert launch_args(["--model", "deepinfer-tiny-coder-fp8", "--file", "x"]).model == str(FP8)


def test_the_bundled_fp8_model_predicts_as_the_float32_one() -> None:
    """Teacher-forced on 1,023 held-out tokens through the engine (weights as stored): top-1
    predictions agree on at least 95% of positions and perplexity is within 1% (measured on 16k
    tokens: 97.9% and +0.005%, bench/results/quality_fp8.json)."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.bench.workload import heldout_stream

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    scores = {}
    for name in ("deepinfer-tiny-coder", "deepinfer-tiny-coder-fp8"):
        llm = LLM(name, num_kv_blocks=128, max_model_len=1040)
        window = heldout_stream(llm.engine.tokenizer)[:1024]
        (out,) = llm.generate(prompt_token_ids=[window], sampling_params=params)
        entries = out.prompt_logprobs[1:]
        scores[name] = (
            [next(t for t, lp in e.items() if lp.rank == 1) for e in entries],
            -sum(e[t].logprob for e, t in zip(entries, window[1:])) / len(entries),
        )
        if name.endswith("fp8"):
            assert llm.engine.weights_summary.startswith("weights fp8 32x32 ue8m0 as stored")
        llm.close()
    (top32, nll32), (top8, nll8) = scores.values()
    assert sum(a == b for a, b in zip(top32, top8)) / len(top32) >= 0.95
    assert abs(math.exp(nll8 - nll32) - 1) < 0.01
