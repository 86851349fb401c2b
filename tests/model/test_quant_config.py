"""``quantization_config`` as typed weight formats, the ``weights`` option, and the startup words."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.quant import WeightFormat
from deepinfer.config import EngineConfig
from deepinfer.model.config import ModelConfig, UnsupportedConfigError
from deepinfer.model.weight_plan import plan_weights
from tests.model.hf_models import BASE

V3 = {**BASE, "model_type": "deepseek_v3"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def parse(**quant) -> ModelConfig:
    return ModelConfig.from_dict({**V3, "quantization_config": {**FP8, **quant}})


def test_deepseek_v3_config_is_fp8_128_blocks_with_f32_scales_everywhere() -> None:
    config = parse()
    assert config.weight_format == WeightFormat("fp8", (128, 128), "f32")
    assert config.expert_weight_format == config.weight_format


def test_block_is_a_parameter_and_ue8m0_is_read() -> None:
    config = parse(weight_block_size=[32, 64], scale_fmt="ue8m0")
    assert config.weight_format == WeightFormat("fp8", (32, 64), "ue8m0")


def test_fp4_experts_are_mxfp4_and_dense_stays_fp8() -> None:
    config = parse(weight_block_size=[32, 32], scale_fmt="ue8m0", expert_dtype="fp4")
    assert config.weight_format == WeightFormat("fp8", (32, 32), "ue8m0")
    assert config.expert_weight_format == WeightFormat("mxfp4", (1, 32), "ue8m0")


def test_unquantised_config_has_no_formats() -> None:
    config = ModelConfig.from_dict(V3)
    assert config.weight_format is None and config.expert_weight_format is None


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method='awq' is not supported; supported: fp8"),
        ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported; supported: e4m3"),
        ({"activation_scheme": "static"}, "activation_scheme='static' is not supported; supported: dynamic"),
        ({"weight_block_size": None}, "weight_block_size=None is not supported; supported: two positive"),
        ({"weight_block_size": [128]}, "weight_block_size=[128] is not supported"),
        ({"weight_block_size": [0, 128]}, "weight_block_size=[0, 128] is not supported"),
        (
            {"scale_fmt": "e4m3"},
            "scale_fmt='e4m3' is not supported; supported: null (float32 scales) or 'ue8m0'",
        ),
        ({"expert_dtype": "int4"}, "expert_dtype='int4' is not supported; supported: null or 'fp8'"),
    ],
)
def test_unsupported_quantization_values_name_the_field(quant: dict, message: str) -> None:
    with pytest.raises(UnsupportedConfigError) as err:
        parse(**quant)
    assert message in str(err.value)


def test_fp4_experts_need_widths_that_are_multiples_of_32() -> None:
    with pytest.raises(
        UnsupportedConfigError,
        match=r"needs moe_intermediate_size a multiple of 32 \(one e8m0 scale per 32 columns\), got 40",
    ):
        ModelConfig.from_dict(
            {**V3, "moe_intermediate_size": 40, "quantization_config": {**FP8, "expert_dtype": "fp4"}}
        )


# ------------------------------------------------------------------ the weights option


def test_weights_option_is_typed_and_checked_against_dtype() -> None:
    assert EngineConfig(model="m").weights == "as-stored"
    assert EngineConfig(model="m", weights="bf16", dtype="bfloat16").weights == "bf16"
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(model="m", weights="fp8")
    with pytest.raises(ValueError, match="weights='bf16' dequantises into bfloat16, but dtype='float32'"):
        EngineConfig(model="m", weights="bf16", dtype="float32")


class _Table:
    """A stand-in op table: which quantised ops run the reference implementation."""

    def __init__(self, backend: str, fallbacks: tuple[str, ...] = ()) -> None:
        self.backend = backend
        self.reference_fallbacks = dict.fromkeys(fallbacks, "portable op")


DENSE = WeightFormat("fp8", (128, 128), "ue8m0")
MX = WeightFormat("mxfp4", (1, 32), "ue8m0")
NAMES = frozenset({"model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"})


def test_reference_backend_keeps_everything_and_the_line_says_so() -> None:
    plan = plan_weights(DENSE, MX, NAMES, "as-stored", torch.float32, _Table("deepinfer.backends.reference",
                        ("fp8_linear", "fused_moe_quant")), fp8_math=False)  # fmt: skip
    assert plan.dense == DENSE and plan.experts == MX and not plan.w8a8
    assert plan.describe() == "weights fp8 128x128 ue8m0 as stored, W8A16 (experts mxfp4 as stored)"
    assert plan.linear("model.layers.0.self_attn.o_proj.weight") is not None
    assert plan.linear("model.layers.0.self_attn.q_a_proj.weight") is None  # not stored quantised
    assert plan.expert_format(1, 64, fused=False) == MX


def test_a_backend_without_kernels_dequantises_at_load_and_says_why() -> None:
    table = _Table("deepinfer.backends.cpu", ("fp8_linear", "fp8_linear_w8a8", "fused_moe_quant"))
    plan = plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.float32, table, fp8_math=False)
    assert plan.dense is None and plan.experts is None
    assert plan.linear("model.layers.0.self_attn.o_proj.weight") is None
    assert plan.describe() == (
        "weights fp8 128x128 ue8m0 dequantised to float32 at load: no fp8_linear kernel on "
        "deepinfer.backends.cpu; no fused_moe_quant kernel on deepinfer.backends.cpu"
    )


def test_w8a8_only_on_fp8_chips_with_16_bit_activations() -> None:
    table = _Table("deepinfer.ops_cuda")
    assert plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.bfloat16, table, fp8_math=True).w8a8
    assert not plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.float32, table, fp8_math=True).w8a8
    assert not plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.bfloat16, table, fp8_math=False).w8a8
    no_w8a8 = _Table("deepinfer.ops_cuda", ("fp8_linear_w8a8",))
    plan = plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.bfloat16, no_w8a8, fp8_math=True)
    assert plan.dense == DENSE and not plan.w8a8


def test_dequantised_choices_and_unquantised_checkpoints() -> None:
    table = _Table("deepinfer.backends.reference")
    plan = plan_weights(DENSE, MX, NAMES, "fp32", torch.float32, table, fp8_math=False)
    assert plan.dense is None and plan.experts is None
    assert plan.describe() == "weights dequantised to float32 (--weights fp32)"
    with pytest.raises(
        ValueError, match="weights='bf16' dequantises into bfloat16, but the model dtype is float32"
    ):
        plan_weights(DENSE, MX, NAMES, "bf16", torch.float32, table, fp8_math=False)
    plain = plan_weights(None, None, frozenset(), "as-stored", torch.bfloat16, table, fp8_math=False)
    assert plain.describe() == "weights bfloat16 (checkpoint not quantised)"


def test_unaligned_expert_merge_is_dequantised_and_stated() -> None:
    plan = plan_weights(DENSE, DENSE, NAMES, "as-stored", torch.float32, _Table("deepinfer.backends.reference"),
                        fp8_math=False)  # fmt: skip
    assert plan.expert_format(1, 96, fused=False) is None  # 96 rows of gate, then up: a block straddles
    assert plan.expert_format(1, 96, fused=True) == DENSE  # one stored [2I, D] matrix: kept as is
    assert (
        "experts fp8 128x128 ue8m0 dequantised to float32 at load: moe_intermediate_size 96"
        in plan.describe()
    )
