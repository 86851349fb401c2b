"""Quantised checkpoints kept as stored (issue 29): random small V3 models written as FP8 block-scaled
checkpoints (blocks 32 and 128, float32 and ue8m0 scales, dimensions that are not multiples of the
block) and with V4-style MXFP4 routed experts, loaded as stored and compared with the same checkpoint
dequantised at load (``weights="fp32"``), the path every comparison is made against.

Tolerances. W8A16 with float32 activations multiplies exactly the dequantised weights the fp32 load
holds (``quant.dequantize`` defines both), so only the order of float32 accumulation may differ
between a backend's per-tile kernel and a dense GEMM: relative error <= 1e-4 of the largest logit
(float32 rounding is 6e-8 per add; the models here are 3 layers of widths <= 800). W8A8 also rounds
every activation to e4m3 (3 mantissa bits: up to 6% per value, a few % per projection, compounding
over some twenty projections) and computes in bfloat16: each layer is checked exactly against its
definition, the model within 0.3 of the largest logit (see the test).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer.backends.quant import WeightFormat, dequantize, quantize_activations_fp8
from deepinfer.backends.registry import active_ops
from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model import loader as loader_module
from deepinfer.model.layers import QuantLinear
from deepinfer.model.loader import CheckpointError, load_model
from deepinfer.model.weight_plan import has_kernel
from deepinfer.parallel.placement import ExpertShard, moe_layers
from tests.model.quant_checkpoints import tiny_quantisable_model, write_quantised
from tests.model.stepping import prompt_logits

PROMPT = [3, 17, 99, 4, 250, 31, 8, 77, 5, 120, 64, 2, 9]
VARIANTS = {
    "fp8-32x32-f32": dict(block=32),
    "fp8-128x128-ue8m0": dict(block=128, scale_fmt="ue8m0"),
    "fp8-ue8m0+mxfp4-experts": dict(block=128, scale_fmt="ue8m0", expert_dtype="fp4"),
    "fp8-32x32+mxfp4-fused-experts": dict(block=32, expert_dtype="fp4", fused=True),
}


@pytest.fixture
def reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference op backend, the oracle, which keeps every quantised weight."""
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "reference")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("hf")
    return path, tiny_quantisable_model(path)


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantised")
    return {name: write_quantised(hf[1], hf[0], root / name, **kw) for name, kw in VARIANTS.items()}


def engine(path: Path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, **options))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def stored_dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


# ---------------------------------------------------------------------------------- (a) logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_as_stored_logits_match_the_model_dequantised_at_load(
    variant: str, checkpoints: dict[str, Path], reference_backend: None
) -> None:
    stored = engine(checkpoints[variant])
    dequantised = engine(checkpoints[variant], weights="fp32")
    quant_linears = [m for m in stored.model.modules() if isinstance(m, QuantLinear)]
    assert quant_linears and all(m.weight.dtype == torch.float8_e4m3fn for m in quant_linears)
    assert not any(isinstance(m, QuantLinear) for m in dequantised.model.modules())
    assert stored_dtypes(dequantised.model) == {torch.float32}
    experts = stored.model.layers[1].mlp.experts
    if "mxfp4" in variant:
        assert (
            experts.fmt.kind == "mxfp4"
            and experts.w13.dtype == torch.uint8
            and experts.w13_scale.dtype == torch.uint8
        )
        assert "(experts mxfp4 as stored)" in stored.weights_summary
    elif variant == "fp8-32x32-f32":
        assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.dtype == torch.float32
    else:  # expert width 64 against 128-row blocks: gate and up scales cannot merge into w13
        assert experts.fmt is None and experts.w13.dtype == torch.float32
        assert "experts fp8 128x128 ue8m0 dequantised to float32 at load" in stored.weights_summary
    assert stored.weights_summary.startswith(f"weights fp8 {VARIANTS[variant]['block']}x")
    assert dequantised.weights_summary == "weights dequantised to float32 (--weights fp32)"
    # kv_b_proj is dequantised once (absorbed MLA), the router stays float32
    assert stored.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert stored.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ours, ref = prompt_logits(stored, PROMPT), prompt_logits(dequantised, PROMPT)
    assert relative_error(ours, ref) <= 1e-4


def test_w8a8_on_a_chip_that_multiplies_fp8(
    hf, tmp_path: Path, reference_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The W8A8 path as an FP8 chip runs it, on the reference ops (the CPU host's chip facts list no
    FP8 math, so the plan is told it has). Each layer is exactly DeepSeek's act_quant per 1 x bk
    (ue8m0 scales for a ue8m0 checkpoint) then the block-scaled product; the whole model, in
    bfloat16 with e4m3 activations, stays within 0.3 of the largest logit of the fp32 dequantised
    model (the tiny random model here is a gentler one, initializer_range 0.02, than the others)."""
    real = loader_module.plan_weights

    def fp8_chip(*args):
        return real(*args[:-1], True)  # the last argument: whether the chip multiplies FP8

    monkeypatch.setattr(loader_module, "plan_weights", fp8_chip)
    gentle = tiny_quantisable_model(tmp_path / "hf", initializer_range=0.02)
    path = write_quantised(
        gentle, tmp_path / "hf", tmp_path / "q", block=128, scale_fmt="ue8m0", expert_dtype="fp4"
    )
    stored = engine(path, dtype="bfloat16")
    linears = [m for m in stored.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.w8a8 for m in linears)
    assert stored.weights_summary.startswith("weights fp8 128x128 ue8m0 as stored, W8A8")
    gen = torch.Generator().manual_seed(0)
    for layer in linears:
        x = torch.randn(5, layer.weight.shape[1], generator=gen).to(torch.bfloat16)
        values, scale = quantize_activations_fp8(x, 128, ue8m0=True)
        x_seen = dequantize(values, scale, WeightFormat("fp8", (1, 128), "ue8m0"))
        expected = torch.nn.functional.linear(x_seen, dequantize(layer.weight, layer.weight_scale, layer.fmt))
        with torch.inference_mode():
            assert torch.equal(layer(x), expected.to(torch.bfloat16))
    ref = prompt_logits(engine(path, weights="fp32"), PROMPT)
    ours = prompt_logits(stored, PROMPT)
    assert relative_error(ours, ref) <= 0.3
    assert (ours.float().argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_the_fast_cpu_backend_keeps_what_it_has_kernels_for(checkpoints: dict[str, Path]) -> None:
    """Whatever kernels the active CPU backend has: a weight stays quantised exactly where it has its
    own kernel, the line says what was dequantised and why, and the logits agree."""
    path = checkpoints["fp8-32x32-f32"]
    stored = engine(path)
    table = active_ops()
    dense_kept = any(isinstance(m, QuantLinear) for m in stored.model.modules())
    assert dense_kept == has_kernel(table, "fp8_linear")
    assert (stored.model.layers[1].mlp.experts.fmt is not None) == has_kernel(table, "fused_moe_quant")
    if not dense_kept:
        assert (
            f"dequantised to float32 at load: no fp8_linear kernel on {table.backend}"
            in stored.weights_summary
        )
    ref = prompt_logits(engine(path, weights="fp32"), PROMPT)
    assert relative_error(prompt_logits(stored, PROMPT), ref) <= 1e-4


# ---------------------------------------------------------------------------------- (b) greedy tokens


@pytest.mark.parametrize(
    ("variant", "backend"),
    [
        ("fp8-32x32-f32", "reference"),
        ("fp8-ue8m0+mxfp4-experts", "reference"),
        ("fp8-ue8m0+mxfp4-experts", "auto"),
    ],
)
def test_greedy_tokens_agree_over_32_prompts(
    variant: str, backend: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``LLM.generate`` (decode graphs and the CPU backend's own kernels with ``auto``)."""
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", backend)
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 24))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for weights in ("as-stored", "fp32"):
        llm = LLM(str(checkpoints[variant]), weights=weights, num_kv_blocks=128)
        if weights == "as-stored" and backend == "reference":
            assert " as stored, W8A16" in llm.engine.weights_summary  # not trivially the same weights
        tokens[weights] = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        llm.close()
    pairs = [(a, b) for s, d in zip(tokens["as-stored"], tokens["fp32"]) for a, b in zip(s, d, strict=True)]
    assert len(pairs) == 32 * 8
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.95


# ---------------------------------------------------------------------------------- (c) memory


def resident_bytes(model, experts_only: bool = False) -> int:
    """Bytes of every parameter and buffer (only the routed experts' with ``experts_only``)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in tensors if not experts_only or ".mlp.experts." in n)


@pytest.fixture(scope="module")
def memory_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Expert width 128 so that 128-row blocks merge; most weights in the layers, as in real models."""
    root = tmp_path_factory.mktemp("memory")
    model = tiny_quantisable_model(
        root / "hf", intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4
    )
    return {
        "fp8-128": write_quantised(model, root / "hf", root / "fp8-128", block=128),
        "fp8-32": write_quantised(model, root / "hf", root / "fp8-32", block=32, scale_fmt="ue8m0"),
        "mxfp4": write_quantised(model, root / "hf", root / "mxfp4", block=128, expert_dtype="fp4"),
    }


def test_resident_weight_memory_against_the_bf16_load(
    memory_checkpoints: dict[str, Path], reference_backend: None
) -> None:
    for name, path in memory_checkpoints.items():
        stored, _ = load_model(path, torch.bfloat16)
        bf16, _ = load_model(path, torch.bfloat16, weights="bf16")
        ratio = resident_bytes(stored) / resident_bytes(bf16)
        assert ratio <= 0.55, (name, ratio)
        if name == "mxfp4":
            experts = resident_bytes(stored, True) / resident_bytes(bf16, True)
            assert experts <= 0.3, experts
        # what was read is what the files store, scales included
        with open(path / "config.json") as f:
            assert json.load(f)["quantization_config"]
        on_disk = 0
        with safe_open(path / "model.safetensors", framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_slice(key)
                on_disk += torch.Size(t.get_shape()).numel() * _itemsize(t.get_dtype())
        assert stored.load_stats.bytes_read == on_disk
        assert bf16.load_stats.bytes_read == on_disk


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}[dtype]


# ---------------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("variant", ["fp8-32x32-f32", "fp8-32x32+mxfp4-fused-experts"])
def test_an_expert_parallel_rank_reads_only_its_experts_as_stored(
    variant: str, checkpoints: dict[str, Path], reference_backend: None
) -> None:
    path = checkpoints[variant]
    full, _ = load_model(path, torch.float32)
    config = full.config
    layers = moe_layers(config)
    phy2log = torch.arange(8).expand(len(layers), -1).clone()
    shard = ExpertShard(1, 2, None, 8, 8, layers, phy2log)  # rank 1 of 2: experts 4..7
    rank, _ = load_model(path, torch.float32, shard=shard)
    for layer in layers:
        mine, whole = rank.layers[layer].mlp.experts, full.layers[layer].mlp.experts
        assert mine.fmt == whole.fmt and mine.fmt is not None
        for a, b in zip(mine.slot_tensors(), whole.slot_tensors(), strict=True):
            assert torch.equal(a.view(torch.uint8), b[4:8].view(torch.uint8))
    assert rank.load_stats.bytes_read < full.load_stats.bytes_read
    if "fused" not in variant:
        assert rank.load_stats.tensors_skipped > 0


# ---------------------------------------------------------------------------------- (d) errors


def rewrite(hf, dst: Path, edit, **kw) -> Path:
    return write_quantised(hf[1], hf[0], dst, **{"block": 32, **kw}, edit=edit)


def test_missing_scale_is_named(hf, tmp_path: Path, reference_backend: None) -> None:
    path = rewrite(hf, tmp_path / "m", lambda t, c: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(
        CheckpointError, match=r"o_proj\.weight is float8_e4m3fn but .*o_proj\.weight_scale_inv is missing"
    ):
        load_model(path, torch.float32)
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    path = rewrite(hf, tmp_path / "e", lambda t, c: t.pop(key), expert_dtype="fp4")
    with pytest.raises(
        CheckpointError,
        match=r"experts\.3\.up_proj\.weight is int8 but .*up_proj\.weight_scale_inv is missing",
    ):
        load_model(path, torch.float32)


def test_misshaped_scale_is_named(hf, tmp_path: Path, reference_backend: None) -> None:
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"

    def shrink(t, c):
        t[key] = t[key][:, :-1].clone()

    with pytest.raises(
        CheckpointError,
        match=r"o_proj\.weight_scale_inv has shape \(7, 2\), expected \(7, 3\) for the 224x96 weight .* in 32x32 blocks",
    ):
        load_model(rewrite(hf, tmp_path / "s", shrink), torch.float32)
    fused = "model.layers.2.mlp.experts.gate_up_proj_scale_inv"

    def drop_expert(t, c):
        t[fused] = t[fused][:-1].clone()

    with pytest.raises(
        CheckpointError, match=r"gate_up_proj_scale_inv has shape \(7, 128, 7\), expected \(8, 128, 7\)"
    ):
        load_model(rewrite(hf, tmp_path / "f", drop_expert, expert_dtype="fp4", fused=True), torch.float32)


def test_wrong_value_dtype_and_stray_scale_are_named(hf, tmp_path: Path, reference_backend: None) -> None:
    def fp8_expert(t, c):
        c["quantization_config"]["expert_dtype"] = "fp4"  # but the experts were written as FP8

    with pytest.raises(
        CheckpointError,
        match=r"experts\.0\.down_proj\.weight is float8_e4m3fn, but quantization_config stores routed experts as mxfp4",
    ):
        load_model(rewrite(hf, tmp_path / "d", fp8_expert), torch.float32)

    def stray(t, c):
        t["model.layers.0.self_attn.q_a_proj.bias_scale_inv"] = torch.ones(1)

    with pytest.raises(
        CheckpointError, match=r"does not use: model\.layers\.0\.self_attn\.q_a_proj\.bias_scale_inv"
    ):
        load_model(rewrite(hf, tmp_path / "x", stray), torch.float32)

    def unannounced(t, c):
        del c["quantization_config"]

    with pytest.raises(
        CheckpointError, match=r"has a block scale .* but config.json has no quantization_config"
    ):
        load_model(rewrite(hf, tmp_path / "u", unannounced), torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method='awq' is not supported; supported: fp8"),
        ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported; supported: e4m3"),
    ],
)
def test_unsupported_format_is_named_at_load(hf, tmp_path: Path, change: dict, message: str) -> None:
    from deepinfer.model.config import UnsupportedConfigError

    path = rewrite(hf, tmp_path / "q", lambda t, c: c["quantization_config"].update(change))
    with pytest.raises(UnsupportedConfigError) as err:
        load_model(path, torch.float32)
    assert message in str(err.value)


def test_missing_values_of_mxfp4_experts_are_named(hf, tmp_path: Path, reference_backend: None) -> None:
    """MXFP4 bytes have no NaN to poison with: the loader tracks which rows it wrote."""
    names = (
        "model.layers.2.mlp.experts.5.down_proj.weight",
        "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv",
    )
    path = rewrite(hf, tmp_path / "v", lambda t, c: [t.pop(n) for n in names], expert_dtype="fp4")
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors for: model\.layers\.2\.mlp\.experts\.\{e\}\.down_proj\.weight",
    ):
        load_model(path, torch.float32)


# ---------------------------------------------------------------------------------- the startup line


@pytest.fixture(scope="module")
def cli_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer-carrying tiny model, quantised to FP8 32x32."""
    import shutil

    from safetensors.torch import load_file

    dst = tmp_path_factory.mktemp("cli") / "q"
    path = write_quantised(load_file(tiny_model / "model.safetensors"), tiny_model, dst, block=32)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model / extra, path / extra)
    return path


CLI_ENV = {
    "DEEPINFER_ACCELERATOR": "cpu",
    "DEEPINFER_CPU_BACKEND": "reference",
    "DEEPINFER_MALLOC_TUNING": "0",
}


def test_run_cli_startup_line_says_what_was_chosen(cli_model: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "deepinfer.run", "--model", str(cli_model), "--max-tokens", "2", *args, "def f():"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **CLI_ENV},
        )  # fmt: skip

    stored = run()
    assert stored.returncode == 0, stored.stderr
    assert "| weights fp8 32x32 f32 as stored, W8A16" in stored.stderr
    dequantised = run("--weights", "fp32")
    assert dequantised.returncode == 0, dequantised.stderr
    assert "| weights dequantised to float32 (--weights fp32)" in dequantised.stderr
    bad = run("--weights", "bf16", "--dtype", "float32")
    assert bad.returncode == 2
    assert "weights='bf16' dequantises into bfloat16, but dtype='float32'" in bad.stderr


def test_serve_banner_says_what_was_chosen(cli_model: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.conftest import REPO_ROOT
    from tests.server.serve_process import free_port

    port = free_port()
    command = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(cli_model), "--port", str(port)]
    command += ["--max-model-len", "256", "--kv-cache-memory-gib", "0.05", "--weights", "fp32"]
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env={**os.environ, **CLI_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    banner = next(line for line in output.splitlines() if line.startswith("deepinfer serve: model"))
    assert "float32, weights dequantised to float32 (--weights fp32)" in banner
