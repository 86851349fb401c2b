"""The fast CPU backend's quantised-weight kernels (``deepinfer.backends.cpu.quant``,
``csrc/quant_gemm.cpp``) against the reference (dequantise, then the float32 op).

Every instruction set this CPU runs (``DEEPINFER_CPU_ISA``), FP8 128x128 blocks with float32 scales,
FP8 32x32 blocks with ue8m0 scales and MXFP4; N and K that are not multiples of the block; row counts
on both sides of the few-row kernel's limit and well past it (the panel path); float32 and bfloat16
activations. Each call's output memory is poisoned first (NaN tensors of the output's size freed just
before, whose memory the allocator mostly hands back), so an element a kernel fails to write shows as
NaN (or as leftover data, which the comparison fails as well).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu import quant as cpu_quant
from deepinfer.backends.cpu.backend import OPS as FAST
from deepinfer.backends.quant import WeightFormat, quantize_weight
from deepinfer.backends.reference import quant as ref_quant
from deepinfer.backends.testing.harness import max_row_error

FAST.finalize()
ISAS = cpu_quant.supported_isas()
FORMATS = [
    WeightFormat("fp8", (128, 128), "f32"),
    WeightFormat("fp8", (32, 32), "ue8m0"),
    WeightFormat("mxfp4", (1, 32), "ue8m0"),
]
ROWS = [1, 3, 16, 17, 25, 300]  # the few-row kernel takes up to 16 rows (24 an expert), the panel path more
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _poison(*shapes: tuple[int, ...]) -> None:
    """Fill, then free, tensors of these shapes: the next allocations of the same sizes reuse NaN memory."""
    junk = [torch.empty(shape).fill_(float("nan")) for shape in shapes for _ in range(16)]
    del junk


def _shape(fmt: WeightFormat, n: int, k: int) -> tuple[int, int]:
    """(N, K) not multiples of the fp8 block; K a multiple of 32 for mxfp4 (its format requires it)."""
    return (n, k) if fmt.kind == "fp8" else (n, (k // 32 + 1) * 32)


def _quantized(fmt: WeightFormat, *shape: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=gen)
    # Blocks of very different magnitudes: a scale applied to the wrong block, or once after the K loop,
    # is far off.
    weight = weight * torch.logspace(-2, 2, shape[-1])[torch.randperm(shape[-1], generator=gen)]
    return quantize_weight(weight, fmt)


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{name}: {out.dtype}{tuple(out.shape)}"
    err = max_row_error(out, ref)
    assert err < TOLERANCE[dtype], f"{name}: worst row relative error {err:.2e}"


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DEEPINFER_CPU_ISA", request.param)
    return request.param


def test_this_cpu_runs_the_vector_kernels() -> None:
    assert ISAS[0] == "generic"
    with open("/proc/cpuinfo") as info:
        flags = info.read()
    if " avx2 " in flags and " f16c " in flags and " fma " in flags:
        assert "avx2" in ISAS
    if all(f" {flag} " in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        assert "avx512" in ISAS


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_linear_matches_the_reference(isa: str, fmt: WeightFormat, dtype: torch.dtype) -> None:
    n, k = _shape(fmt, 200, 300)
    weight, scale = _quantized(fmt, n, k)
    bias = torch.randn(n).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        for b in (None, bias):
            ref = ref_quant.fp8_linear(x, weight, scale, fmt.block, b)
            _poison((rows, n))
            out = FAST.fp8_linear(x, weight, scale, fmt.block, b)
            _assert_close(f"fp8_linear {isa} {fmt.name} rows={rows} bias={b is not None}", out, ref, dtype)


def test_fp8_linear_takes_leading_dims_and_w8a8(isa: str) -> None:
    fmt = FORMATS[0]
    weight, scale = _quantized(fmt, 70, 150)
    x = torch.randn(2, 5, 150)
    ref = ref_quant.fp8_linear(x, weight, scale, fmt.block, None)
    _assert_close(
        "fp8_linear [2, 5, K]", FAST.fp8_linear(x, weight, scale, fmt.block, None), ref, torch.float32
    )
    xv, xs = ref_quant.quant_fp8_group(torch.randn(9, 150), 128, True)
    ref = ref_quant.fp8_linear_w8a8(xv, xs, weight, scale, fmt.block, None, torch.bfloat16)
    out = FAST.fp8_linear_w8a8(xv, xs, weight, scale, fmt.block, None, torch.bfloat16)
    _assert_close("fp8_linear_w8a8", out, ref, torch.bfloat16)


def _moe_inputs(fmt: WeightFormat, experts: int = 6, dim: int = 170, inter: int = 90):
    dim, inter = _shape(fmt, 0, dim)[1], _shape(fmt, 0, inter)[1]
    w13, s13 = _quantized(fmt, experts, 2 * inter, dim, seed=1)
    w2, s2 = _quantized(fmt, experts, dim, inter, seed=2)
    return dim, w13, s13, w2, s2


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_gemm_quant_matches_the_reference(isa: str, fmt: WeightFormat, dtype: torch.dtype) -> None:
    dim, w13, s13, _, _ = _moe_inputs(fmt)
    gen = torch.Generator().manual_seed(3)
    for rows in ROWS:
        # expert 0 empty, expert 1 most rows (past the few-row limit at 300), the rest few
        sizes = torch.bincount(torch.randint(1, 6, (rows,), generator=gen) ** 2 % 6, minlength=6)
        x = torch.randn(rows, dim, generator=gen).to(dtype)
        ref = ref_quant.grouped_gemm_quant(x, w13, s13, fmt, sizes)
        _poison(tuple(ref.shape))
        out = FAST.grouped_gemm_quant(x, w13, s13, fmt, sizes)
        _assert_close(f"grouped_gemm_quant {isa} {fmt.name} rows={rows}", out, ref, dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_quant_matches_the_reference(isa: str, fmt: WeightFormat, dtype: torch.dtype) -> None:
    dim, w13, s13, w2, s2 = _moe_inputs(fmt)
    gen = torch.Generator().manual_seed(4)
    for tokens in ROWS:
        hidden = torch.randn(tokens, dim, generator=gen).to(dtype)
        ids = torch.randint(0, 6, (tokens, 4), generator=gen)
        ids[0, 2] = -1  # another rank's expert: contributes nothing
        weights = torch.rand(tokens, 4, generator=gen)
        ref = ref_quant.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids)
        _poison(tuple(ref.shape))
        out = FAST.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids)
        _assert_close(f"fused_moe_quant {isa} {fmt.name} tokens={tokens}", out, ref, dtype)


def test_deterministic_mode_gives_a_row_the_same_bits_in_any_batch() -> None:
    routes = FAST.invariance()
    for name in ("fp8_linear", "fp8_linear_w8a8", "grouped_gemm_quant", "fused_moe_quant"):
        assert routes[name].formulation == "invariant", name
    fmt = FORMATS[0]
    weight, scale = _quantized(fmt, 200, 300)
    batch = torch.randn(300, 300)
    invariant = FAST.deterministic_implementation("fp8_linear")
    alone = invariant(batch[7:8], weight, scale, fmt.block, None)
    assert torch.equal(invariant(batch, weight, scale, fmt.block, None)[7:8], alone)
    dim, w13, s13, w2, s2 = _moe_inputs(fmt)
    hidden = torch.randn(300, dim)
    ids = torch.randint(0, 6, (300, 4))
    weights = torch.rand(300, 4)
    moe = FAST.deterministic_implementation("fused_moe_quant")
    one = moe(hidden[5:6], w13, s13, w2, s2, fmt, weights[5:6], ids[5:6])
    assert torch.equal(moe(hidden, w13, s13, w2, s2, fmt, weights, ids)[5:6], one)


def test_the_instruction_sets_agree_closely() -> None:
    fmt = FORMATS[1]
    weight, scale = _quantized(fmt, 100, 200)
    x = torch.randn(5, 200)
    outs = [torch.ops.deepinfer_cpu.quant_linear(x, weight, scale, 0, 32, 32, None, code, 32) for code in
            range(len(ISAS))]  # fmt: skip
    for other in outs[1:]:
        assert max_row_error(other, outs[0]) < 1e-6


def test_bad_inputs_are_value_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = FORMATS[0]
    weight, scale = _quantized(fmt, 200, 300)
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match="scale has shape"):
        FAST.fp8_linear(x, weight, scale[:, :1], fmt.block, None)
    with pytest.raises(ValueError, match="must end in the weight's K"):
        FAST.fp8_linear(torch.randn(2, 299), weight, scale, fmt.block, None)
    with pytest.raises(ValueError, match="float8_e4m3fn values"):
        FAST.fp8_linear(x, weight.view(torch.uint8), scale, fmt.block, None)
    with pytest.raises(ValueError, match="instruction set code"):
        torch.ops.deepinfer_cpu.quant_linear(x, weight, scale, 0, 128, 128, None, 7, 32)
    monkeypatch.setenv("DEEPINFER_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_ISA"):
        FAST.fp8_linear(x, weight, scale, fmt.block, None)
    monkeypatch.delenv("DEEPINFER_CPU_ISA")
    dim, w13, s13, w2, s2 = _moe_inputs(fmt)
    with pytest.raises(ValueError, match="outside"):
        FAST.fused_moe_quant(
            torch.randn(1, dim), w13, s13, w2, s2, fmt, torch.ones(1, 1), torch.tensor([[6]])
        )
    with pytest.raises(ValueError, match="group_sizes sum"):
        FAST.grouped_gemm_quant(torch.randn(3, dim), w13, s13, fmt, torch.tensor([1, 1, 0, 0, 0, 0]))


def test_the_ops_replay_in_a_cpu_graph() -> None:
    """A decode step runs as a CPU graph: each op is one native call that records and replays (no host
    read, no tensor made from host data), its replay equal to a fresh eager call."""
    from deepinfer.backends.cpu.graph import CpuGraph

    fmt = FORMATS[2]
    dim, w13, s13, w2, s2 = _moe_inputs(fmt)
    weight, scale = _quantized(FORMATS[0], 200, dim)
    hidden = torch.randn(3, dim)
    ids = torch.randint(0, 6, (3, 4))
    weights = torch.rand(3, 4)

    def step():
        projected = FAST.fp8_linear(hidden, weight, scale, FORMATS[0].block, None)
        return projected, FAST.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids)

    with torch.inference_mode():
        graph = CpuGraph()
        captured = graph.capture(step)
        for seed in range(2):
            hidden.copy_(torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            for got, want in zip(captured, step()):
                assert torch.equal(got, want)
