"""Quantised weights on Ascend (issue 29), against the torch_npu emulation: each op matches the reference
(N and K not multiples of the block, blocks 128 and 32, f32 and ue8m0 scales, FP8 and MXFP4 experts), the
chip decides the path (A2 / A3: dequantise; 950: npu_quant_matmul G-B / MX and npu_dynamic_mx_quant), the
950 takes the exact dequantise path for scales its MX mode cannot hold, and misuse raises ValueError."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from deepinfer.backends.quant import WeightFormat, dequantize, quantize_weight, unpack_e2m1
from deepinfer.backends.registry import OpTable, load_backend
from deepinfer.platform.interface import DeviceGraph
from tests.ascend import emulation
from tests.ascend.conftest import ON_ASCEND
from tests.ascend.test_conformance_emulated import run_suite

A2, A3, A5_PR, A5_DT = "Ascend910B3", "Ascend910_9382", "Ascend950PR", "Ascend950DT"
FP8_128_F32 = WeightFormat("fp8", (128, 128), "f32")
FP8_128_UE8M0 = WeightFormat("fp8", (128, 128), "ue8m0")
FP8_32_UE8M0 = WeightFormat("fp8", (32, 32), "ue8m0")
FP8_32_F32 = WeightFormat("fp8", (32, 32), "f32")
MXFP4 = WeightFormat("mxfp4", (1, 32), "ue8m0")
# (N, K) per block: neither a multiple of the block
SHAPES = {128: (200, 300), 32: (70, 90)}


@pytest.fixture
def reference() -> OpTable:
    return load_backend("deepinfer.backends.reference")


@pytest.fixture
def quant(npu_emulation: None) -> Any:
    from deepinfer.ops_ascend import quant

    return quant


@pytest.fixture
def device(quant: Any) -> Iterator[Callable[[str], None]]:
    """Set the emulated chip (and make the backend read it again); the A2 default is restored after."""

    def set_chip(name: str) -> None:
        emulation.set_device_name(name)
        quant.chip.cache_clear()

    set_chip(A2)
    yield set_chip
    set_chip(A2)


@pytest.fixture
def calls(npu_emulation: None, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """Records the keyword arguments of every npu_quant_matmul / npu_dynamic_mx_quant call."""
    record: dict[str, list[dict[str, Any]]] = {"npu_quant_matmul": [], "npu_dynamic_mx_quant": []}
    npu = sys.modules["torch_npu"]
    for name in record:
        op = getattr(npu, name)

        def spy(*args: Any, _op: Any = op, _name: str = name, **kwargs: Any) -> Any:
            record[_name].append(kwargs)
            return _op(*args, **kwargs)

        monkeypatch.setattr(npu, name, spy)
    return record


def weight(fmt: WeightFormat, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(n, k, generator=g), fmt)


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    scale = expected.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= tol * scale, f"max error {err} above {tol} x {scale}"


# ------------------------------------------------------------------------------------------- decoding


def test_decoders_match_the_format_definition(quant: Any) -> None:
    """Every e4m3 byte (NaN included) and every pair of e2m1 nibbles decodes as the format defines."""
    every = torch.arange(256, dtype=torch.uint8)
    ours, torch_cast = (
        quant.e4m3_to_float(every.view(torch.float8_e4m3fn)),
        every.view(torch.float8_e4m3fn).float(),
    )
    assert torch.equal(ours.isnan(), torch_cast.isnan()) and torch.equal(
        ours.nan_to_num(7.0), torch_cast.nan_to_num(7.0)
    )
    assert torch.equal(quant.e2m1_to_float(every), unpack_e2m1(every))  # low nibble = even column


@pytest.mark.parametrize("fmt", [FP8_128_F32, FP8_32_UE8M0, MXFP4], ids=lambda f: f.name)
def test_tiled_dequantisation_is_the_definition(
    quant: Any, fmt: WeightFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiles of a few rows (partial blocks at tile and matrix edges) give quant.dequantize exactly, for
    one matrix and for stacked experts (decoded per expert, or as one matrix when N is whole blocks)."""
    monkeypatch.setattr(quant, "TILE_ELEMENTS", 3 * 300 * max(fmt.block[0], 1))
    for n, k in ((200, 300), (256, 300)) if fmt.block[0] == 128 else ((70, 96), (64, 96)):
        values, scale = weight(fmt, n, k)
        expected = dequantize(values, scale, fmt)
        assert torch.equal(quant.dequantize_to(values, scale, fmt, torch.float32), expected)
        experts = [weight(fmt, n, k, seed) for seed in range(3)]
        stacked = torch.stack([v for v, _ in experts]), torch.stack([s for _, s in experts])
        assert torch.equal(quant.dequantize_to(*stacked, fmt, torch.float32), dequantize(*stacked, fmt))


# ------------------------------------------------------------------------------------------- chips


@pytest.mark.parametrize(
    "name, fp8", [(A2, False), (A3, False), ("Ascend910C", False), (A5_PR, True), (A5_DT, True)]
)
def test_the_chip_decides_fp8_matmul(quant: Any, device: Callable[[str], None], name: str, fp8: bool) -> None:
    device(name)
    assert quant.multiplies_fp8() is fp8


def test_an_unknown_chip_is_an_error(quant: Any, device: Callable[[str], None]) -> None:
    device("Ascend310P3")
    with pytest.raises(RuntimeError, match="Ascend310P3"):
        quant.multiplies_fp8()


def test_the_emulation_refuses_fp8_where_the_documentation_does(
    npu_emulation: None, device: Callable[[str], None]
) -> None:
    npu = sys.modules["torch_npu"]
    x = torch.randn(4, 64).to(torch.float8_e4m3fn)
    for name in (A2, A3):
        device(name)
        with pytest.raises(RuntimeError, match="950"):
            npu.npu_quant_matmul(
                x,
                x.t(),
                torch.ones(1, 1),
                pertoken_scale=torch.ones(4, 1),
                output_dtype=torch.float32,
                group_sizes=[1, 128, 128],
            )
        with pytest.raises(RuntimeError, match="950"):
            npu.npu_dynamic_mx_quant(
                torch.randn(4, 64, dtype=torch.bfloat16), dst_type=torch.float8_e4m3fn, scale_alg=1
            )


# ------------------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("chip", [A2, A5_PR])
@pytest.mark.parametrize("fmt", [FP8_128_F32, FP8_128_UE8M0, FP8_32_UE8M0], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7])
def test_fp8_linear_is_w8a16_on_every_chip(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    chip: str,
    fmt: WeightFormat,
    dtype: torch.dtype,
    rows: int,
) -> None:
    device(chip)
    n, k = SHAPES[fmt.block[0]]
    values, scale = weight(fmt, n, k)
    x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    for b in (None, bias):
        out = ascend_ops.fp8_linear(x, values, scale, fmt.block, b)
        close(out, reference.fp8_linear(x, values, scale, fmt.block, b), dtype)
    assert not calls["npu_quant_matmul"], "W8A16 must not quantise the activations"


@pytest.mark.parametrize("group, k", [(128, 300), (32, 90), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_act_quant_on_the_950_is_deepseeks_bit_for_bit(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    group: int,
    k: int,
    dtype: torch.dtype,
) -> None:
    device(A5_PR)
    x = (torch.randn(9, k) * torch.logspace(-6, 2, 9)[:, None]).to(dtype)
    x[3] = 0  # amax floor 1e-4
    values, scale = ascend_ops.quant_fp8_group(x, group, True)
    expected_values, expected_scale = reference.quant_fp8_group(x, group, True)
    assert len(calls["npu_dynamic_mx_quant"]) == 1
    assert (
        calls["npu_dynamic_mx_quant"][0]["scale_alg"] == 1
        and calls["npu_dynamic_mx_quant"][0]["block_size"] == group
    )
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


@pytest.mark.parametrize(
    "chip, dtype, group, ue8m0",
    [
        (A5_PR, torch.bfloat16, 128, False),
        (A5_PR, torch.float32, 128, True),
        (A5_PR, torch.bfloat16, 48, True),
        (A2, torch.bfloat16, 128, True),
    ],
)
def test_act_quant_outside_the_mx_op_runs_the_reference(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    chip: str,
    dtype: torch.dtype,
    group: int,
    ue8m0: bool,
) -> None:
    """f32 scales (no power of two), float32 x with a group above 32, a group not a multiple of 32, A2."""
    device(chip)
    x = torch.randn(5, 200).to(dtype)
    values, scale = ascend_ops.quant_fp8_group(x, group, ue8m0)
    expected_values, expected_scale = reference.quant_fp8_group(x, group, ue8m0)
    assert not calls["npu_dynamic_mx_quant"]
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8)) and torch.equal(
        scale, expected_scale
    )


def w8a8_inputs(reference: OpTable, fmt: WeightFormat, act_ue8m0: bool, rows: int = 6) -> tuple:
    n, k = SHAPES[fmt.block[0]]
    values, scale = weight(fmt, n, k)
    x_values, x_scale = reference.quant_fp8_group(torch.randn(rows, k), fmt.block[1], act_ue8m0)
    return x_values, x_scale, values, scale, torch.randn(n)


@pytest.mark.parametrize("fmt", [FP8_128_F32, FP8_32_UE8M0, FP8_32_F32], ids=lambda f: f.name)
def test_w8a8_on_a2_dequantises(
    ascend_ops: OpTable, reference: OpTable, device: Callable[[str], None], calls: dict, fmt: WeightFormat
) -> None:
    device(A3)
    x_values, x_scale, values, scale, bias = w8a8_inputs(reference, fmt, fmt.scale_fmt == "ue8m0")
    for out_dtype in (torch.float32, torch.bfloat16):
        out = ascend_ops.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, bias, out_dtype)
        close(
            out,
            reference.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, bias, out_dtype),
            out_dtype,
        )
    assert not calls["npu_quant_matmul"]


@pytest.mark.parametrize("fmt", [FP8_128_F32, FP8_128_UE8M0], ids=lambda f: f.name)
@pytest.mark.parametrize("chip", [A5_PR, A5_DT])
def test_w8a8_128_blocks_on_the_950_run_gb_mode_exactly(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    fmt: WeightFormat,
    chip: str,
) -> None:
    """V3 / R1 f32 block scales included: the G-B mode applies float32 block scales inside the K loop."""
    device(chip)
    x_values, x_scale, values, scale, bias = w8a8_inputs(reference, fmt, fmt.scale_fmt == "ue8m0")
    for b, out_dtype in ((None, torch.float32), (bias, torch.float32), (bias, torch.bfloat16)):
        out = ascend_ops.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, b, out_dtype)
        close(
            out,
            reference.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, b, out_dtype),
            out_dtype,
        )
    assert [c["group_sizes"] for c in calls["npu_quant_matmul"]] == [[1, 128, 128]] * 3


@pytest.mark.parametrize("block", [(32, 32), (64, 32), (128, 64)])
def test_w8a8_power_of_two_scales_on_the_950_run_mx_mode(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    block: tuple[int, int],
) -> None:
    device(A5_PR)
    fmt = WeightFormat("fp8", block, "ue8m0")
    n, k = 70, 90
    values, scale = weight(fmt, n, k)
    x_values, x_scale = reference.quant_fp8_group(torch.randn(5, k), block[1], True)
    bias = torch.randn(n)
    out = ascend_ops.fp8_linear_w8a8(x_values, x_scale, values, scale, block, bias, torch.float32)
    close(
        out,
        reference.fp8_linear_w8a8(x_values, x_scale, values, scale, block, bias, torch.float32),
        torch.float32,
    )
    (call,) = calls["npu_quant_matmul"]
    assert (
        call["group_sizes"] == [1, 1, 32] and call["scale_dtype"] is sys.modules["torch_npu"].float8_e8m0fnu
    )


def test_w8a8_f32_scales_on_the_950_take_the_exact_dequantise_path(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    calls: dict,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MX (1x32) scales hold powers of two only: f32 weight or activation scales with a block other than
    128x128 are dequantised (and logged), never re-expressed inexactly."""
    device(A5_PR)
    for fmt, act_ue8m0, reason in (
        (FP8_32_F32, True, "weight scales"),
        (FP8_32_UE8M0, False, "activation scales"),
    ):
        x_values, x_scale, values, scale, bias = w8a8_inputs(reference, fmt, act_ue8m0)
        with caplog.at_level(logging.WARNING):
            out = ascend_ops.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, bias, torch.float32)
        close(
            out,
            reference.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, bias, torch.float32),
            torch.float32,
        )
        assert reason in caplog.text
    assert not calls["npu_quant_matmul"]


def test_w8a8_mx_scales_follow_the_weight_and_graph_capture(
    ascend_ops: OpTable,
    reference: OpTable,
    quant: Any,
    device: Callable[[str], None],
    calls: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MX re-expression is cached per weight-scale tensor and version; a capture (no host reads) takes
    the MX path only for a weight whose activations an eager call checked."""
    device(A5_PR)
    x_values, x_scale, values, scale, bias = w8a8_inputs(reference, FP8_32_UE8M0, True)

    def run() -> None:
        out = ascend_ops.fp8_linear_w8a8(x_values, x_scale, values, scale, (32, 32), bias, torch.float32)
        close(
            out,
            reference.fp8_linear_w8a8(x_values, x_scale, values, scale, (32, 32), bias, torch.float32),
            torch.float32,
        )

    monkeypatch.setattr(quant, "_capturing", lambda: True)
    run()
    assert not calls["npu_quant_matmul"]  # never checked eagerly: dequantised
    monkeypatch.setattr(quant, "_capturing", lambda: False)
    run()
    monkeypatch.setattr(quant, "_capturing", lambda: True)
    run()
    assert len(calls["npu_quant_matmul"]) == 2
    scale.mul_(1.5)  # in place: no longer powers of two; the cache sees the new version
    monkeypatch.setattr(quant, "_capturing", lambda: False)
    run()
    assert len(calls["npu_quant_matmul"]) == 2


# ------------------------------------------------------------------------------------------- experts


def expert_weights(
    fmt: WeightFormat, experts: int, n: int, k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(experts, n, k, generator=g) * 0.3, fmt)


EXPERT_CASES = [(FP8_128_F32, 200, 72), (FP8_32_UE8M0, 90, 40), (MXFP4, 96, 64)]


@pytest.mark.parametrize("chip", [A2, A5_PR])
@pytest.mark.parametrize("fmt, d, inter", EXPERT_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_grouped_gemm_quant_matches_the_reference(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    chip: str,
    fmt: WeightFormat,
    d: int,
    inter: int,
) -> None:
    device(chip)
    values, scale = expert_weights(fmt, 4, 2 * inter, d, seed=1)
    sizes = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, d).to(torch.bfloat16)
    out = ascend_ops.grouped_gemm_quant(x, values, scale, fmt, sizes)
    close(out, reference.grouped_gemm_quant(x, values, scale, fmt, sizes), torch.bfloat16)


@pytest.mark.parametrize("chip", [A3, A5_DT])
@pytest.mark.parametrize("fmt, d, inter", EXPERT_CASES, ids=lambda c: getattr(c, "name", str(c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_quant_matches_the_reference(
    ascend_ops: OpTable,
    reference: OpTable,
    device: Callable[[str], None],
    chip: str,
    fmt: WeightFormat,
    d: int,
    inter: int,
    dtype: torch.dtype,
) -> None:
    device(chip)
    experts, tokens = 4, 6
    w13, w13_scale = expert_weights(fmt, experts, 2 * inter, d, seed=2)
    w2, w2_scale = expert_weights(fmt, experts, d, inter, seed=3)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    ids[1, 0] = -1  # a remote expert: contributes nothing
    weights = torch.rand(tokens, 2, generator=g)
    args = (hidden, w13, w13_scale, w2, w2_scale, fmt, weights, ids)
    close(ascend_ops.fused_moe_quant(*args), reference.fused_moe_quant(*args), dtype)


# ------------------------------------------------------------------------------------------- graphs


def graph_cases(
    reference: OpTable,
) -> dict[str, tuple[str, Callable[[OpTable, list[torch.Tensor]], torch.Tensor], list[torch.Tensor]]]:
    values, scale = weight(FP8_128_F32, 200, 300)
    mx_values, mx_scale = weight(FP8_32_UE8M0, 70, 90)
    w13, w13_scale = expert_weights(MXFP4, 4, 64, 96, seed=6)
    w2, w2_scale = expert_weights(MXFP4, 4, 96, 32, seed=7)
    x_values, x_scale = reference.quant_fp8_group(torch.randn(4, 90), 32, True)
    ids = torch.tensor([[0, 3], [2, -1], [1, 2]], dtype=torch.int32)
    return {
        "fp8_linear-A2": (
            A2,
            lambda ops, a: ops.fp8_linear(a[0], values, scale, (128, 128), None),
            [torch.randn(3, 300).bfloat16()],
        ),
        "act-quant-950": (
            A5_PR,
            lambda ops, a: ops.quant_fp8_group(a[0], 128, True)[0].float(),
            [torch.randn(3, 300).bfloat16()],
        ),
        "w8a8-mx-950": (
            A5_PR,
            lambda ops, a: ops.fp8_linear_w8a8(
                a[0], a[1], mx_values, mx_scale, (32, 32), None, torch.float32
            ),
            [x_values, x_scale],
        ),
        "moe-mxfp4-A3": (
            A3,
            lambda ops, a: ops.fused_moe_quant(a[0], w13, w13_scale, w2, w2_scale, MXFP4, a[1], ids),
            [torch.randn(3, 96).bfloat16(), torch.rand(3, 2)],
        ),
    }


@pytest.mark.parametrize("case", ["fp8_linear-A2", "act-quant-950", "w8a8-mx-950", "moe-mxfp4-A3"])
def test_the_quantised_ops_capture_and_replay(
    ascend_ops: OpTable, reference: OpTable, device: Callable[[str], None], calls: dict, case: str
) -> None:
    """Captured after the warm-up run (no host reads while capturing: the emulation raises on one),
    a graph replays with new inputs to the eager result; the 950's MX path stays in the graph."""
    chip, fn, inputs = graph_cases(reference)[case]
    device(chip)
    graph = DeviceGraph(torch.npu, torch.npu.NPUGraph)
    out = graph.capture(lambda: fn(ascend_ops, inputs))
    g = torch.Generator().manual_seed(8)
    first = inputs[0]
    if first.dtype == torch.float8_e4m3fn:  # new activations: the rows reversed (scales alike)
        for t in inputs:
            t.copy_(t.flip(0))
    else:
        first.copy_(torch.randn(first.shape, generator=g).to(first.dtype))
    graph.replay()
    assert torch.equal(out, fn(ascend_ops, inputs))
    if case == "w8a8-mx-950":
        assert len(calls["npu_quant_matmul"]) == 3  # warm-up, capture and the eager check: all MX mode


# ------------------------------------------------------------------------------------------- deterministic mode


def test_deterministic_mode_runs_the_byte_decoding_formulations(
    ascend_ops: OpTable, reference: OpTable
) -> None:
    routes = ascend_ops.invariance()
    for name in ("fp8_linear", "fp8_linear_w8a8", "grouped_gemm_quant", "fused_moe_quant"):
        assert routes[name].formulation == "invariant", name
        assert "bytes" in routes[name].note
    from deepinfer.ops_ascend import quant_invariant

    values, scale = weight(FP8_128_F32, 200, 300)
    x = torch.randn(7, 300)
    batch = quant_invariant.fp8_linear(x, values, scale, (128, 128), None)
    close(batch, reference.fp8_linear(x, values, scale, (128, 128), None), torch.float32)
    assert torch.equal(quant_invariant.fp8_linear(x[4:5], values, scale, (128, 128), None), batch[4:5])


# ------------------------------------------------------------------------------------------- misuse


def test_misuse_is_caught(ascend_ops: OpTable, reference: OpTable, device: Callable[[str], None]) -> None:
    device(A5_PR)
    values, scale = weight(FP8_128_F32, 200, 300)
    x = torch.randn(3, 300)
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: ascend_ops.fp8_linear(x, values.float(), scale, (128, 128), None), "float8_e4m3fn"),
        (lambda: ascend_ops.fp8_linear(x, values, scale.t(), (128, 128), None), "expected"),
        (lambda: ascend_ops.fp8_linear(x, values, scale, (32, 32), None), "expected"),
        (lambda: ascend_ops.fp8_linear(x[:, :299], values, scale, (128, 128), None), "K="),
        (lambda: ascend_ops.fp8_linear(x[None], values, scale, (128, 128), None), r"\[T, K\]"),
        (
            lambda: ascend_ops.fp8_linear(x.to(torch.int32), values, scale, (128, 128), None),
            "float32, bfloat16",
        ),
        (lambda: ascend_ops.fp8_linear(x, values, scale, (128, 128), torch.zeros(199)), "bias"),
        (lambda: ascend_ops.quant_fp8_group(x, 0, True), "positive"),
        (lambda: ascend_ops.quant_fp8_group(x[0], 128, True), r"\[M, K\]"),
    ]
    x_values, x_scale = reference.quant_fp8_group(x, 128, False)
    cases += [
        (
            lambda: ascend_ops.fp8_linear_w8a8(
                x_values, x_scale, values, scale, (128, 128), None, torch.int8
            ),
            "out_dtype",
        ),
        (
            lambda: ascend_ops.fp8_linear_w8a8(
                x_values, x_scale[:, :2], values, scale, (128, 128), None, torch.float32
            ),
            "activations",
        ),
        (
            lambda: ascend_ops.fp8_linear_w8a8(x, x_scale, values, scale, (128, 128), None, torch.float32),
            "activations",
        ),
    ]
    w, s = expert_weights(MXFP4, 3, 16, 64, seed=5)
    hidden = torch.randn(2, 64)
    cases += [
        (
            lambda: ascend_ops.grouped_gemm_quant(hidden, w, s, FP8_32_UE8M0, torch.tensor([1, 1, 0])),
            "mxfp4|fp8",
        ),
        (lambda: ascend_ops.grouped_gemm_quant(hidden, w, s, MXFP4, torch.tensor([1, 1])), "group_sizes"),
        (lambda: ascend_ops.grouped_gemm_quant(hidden[:, :32], w, s, MXFP4, torch.tensor([1, 1, 0])), "K=64"),
        (lambda: ascend_ops.grouped_gemm_quant(hidden, w[0], s[0], MXFP4, torch.tensor([2])), r"\[E, N, K\]"),
        (
            lambda: ascend_ops.fused_moe_quant(
                hidden, w, s, w, s, MXFP4, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
            ),
            "w2 must be",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# ------------------------------------------------------------------------------------------- conformance suite


@pytest.mark.slow
@pytest.mark.skipif(ON_ASCEND, reason="on an NPU, ci/ascend.sh runs the suite on the device")
@pytest.mark.parametrize("chip", [A2, A5_PR])
def test_the_conformance_suite_quant_checks_pass_per_chip(chip: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend suite's quantised-weight checks on the emulated A2 (dequantise paths) and 950
    (npu_quant_matmul / npu_dynamic_mx_quant paths)."""
    monkeypatch.setenv("DEEPINFER_EMULATED_NPU", chip)
    proc = run_suite("bfloat16,float16,float32", "-k", "quant or fp8")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
