"""The Triton kernels for quantised weights (ops_cuda.quant_codec, quant_linear, quant_moe) against the
reference: FP8 block-scaled and MXFP4 weights, f32 and ue8m0 scales, 128 and 32 blocks, N and K not
multiples of the block, 1 to 4096 rows, outputs prefilled with NaN (every element must be written).

Without a GPU the kernels run in Triton's interpreter (float32/float16; its bfloat16 is broken). Both
ways of reading FP8 run there: as ``float8_e4m3fn`` (what SM89+ compiles: FP8 tensor-core dots for
W8A8, hardware conversion for W8A16) and as bytes decoded by bit operations (what SM80/SM86 compile).
What the interpreter proves is the kernels' arithmetic (tiling, masks, scale indexing, per-K-block
scaling, nibble order, codecs); that the compiled FP8 dot and conversions match it is proven only on a
GPU, where this file runs compiled.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deepinfer.backends.quant import WeightFormat, quantize_activations_fp8, quantize_weight
from deepinfer.backends.reference import OPS as REF
from tests.nvidia.conftest import DEVICE

triton = pytest.importorskip("triton")
tl = triton.language

from deepinfer.ops_cuda import quant_codec, quant_linear, quant_moe  # noqa: E402

ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative Frobenius error


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    assert torch.isfinite(got).all(), "non-finite output (an element left unwritten?)"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _nan_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty, filled with NaN (float), the e4m3 NaN code (FP8) or 0xFF (bytes)."""
    t = torch.empty(*args, **kwargs)
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


@pytest.fixture
def nan_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_linear, "empty", _nan_empty)
    monkeypatch.setattr(quant_moe, "empty", _nan_empty)


# ------------------------------------------------------------------------------------------ codecs


@triton.jit
def _codec_kernel(
    x_ptr, code_ptr, back_ptr, byte_value_ptr, byte_ptr, e2m1_ptr, e8m0_ptr, pow2_ptr, n, B: tl.constexpr
):
    i = tl.program_id(0) * B + tl.arange(0, B)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    code = quant_codec.e4m3_encode(x)
    tl.store(code_ptr + i, code, mask=ok)
    tl.store(back_ptr + i, quant_codec.e4m3_decode(code), mask=ok)
    byte = (i & 0xFF).to(tl.int32)
    tl.store(byte_value_ptr + i, quant_codec.e4m3_decode(byte.to(tl.uint8)), mask=ok)
    tl.store(byte_ptr + i, byte, mask=ok)
    tl.store(e2m1_ptr + i, quant_codec.e2m1_decode(byte & 0xF), mask=ok)
    tl.store(e8m0_ptr + i, quant_codec.e8m0_to_float(byte), mask=ok)
    tl.store(pow2_ptr + i, quant_codec.round_up_pow2(tl.abs(x) + 1e-30), mask=ok)


def test_codecs_match_the_formats_bit_for_bit(cuda_ops) -> None:
    """e4m3 encode = torch's cast (ties to even, carries into the exponent, subnormals), decode = the
    format for all 254 finite codes, e2m1 = the table, e8m0 = 2**(e-127), ue8m0 rounding goes up."""
    gen = torch.Generator().manual_seed(0)
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()].sort().values
    midpoints = (finite[1:] + finite[:-1]) / 2  # exact ties: round to the even code
    x = torch.cat([
        torch.randn(4000, generator=gen) * 100, torch.randn(4000, generator=gen) * 0.01,
        torch.rand(2000, generator=gen) * 0.02, finite, midpoints, torch.tensor([31.6, -126.3, 1e-30, -0.0]),
    ]).clamp(-448, 448)  # fmt: skip
    n = x.numel()
    outs = [torch.empty(n, dtype=d) for d in (torch.uint8, torch.float32, torch.float32, torch.int32)]
    outs += [torch.empty(n) for _ in range(3)]
    args = [x.to(DEVICE)] + [o.to(DEVICE) for o in outs]
    _codec_kernel[(triton.cdiv(n, 1024),)](*args, n, B=1024)
    code, back, byte_value, byte, e2m1, e8m0, pow2 = (a.cpu() for a in args[1:])
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(code, want.view(torch.uint8))
    assert torch.equal(back, want.float())
    finite_code = (byte & 0x7F) != 0x7F
    assert torch.equal(
        byte_value[finite_code], byte.to(torch.uint8).view(torch.float8_e4m3fn).float()[finite_code]
    )
    from deepinfer.backends.quant import E2M1_VALUES, e8m0_to_float

    assert torch.equal(e2m1, torch.tensor(E2M1_VALUES)[byte & 0xF])
    normal = (byte > 0) & (byte < 255)  # 0 is a float32 subnormal (flushed on some GPUs), 255 NaN
    assert torch.equal(e8m0[normal], e8m0_to_float(byte.to(torch.uint8))[normal])
    assert bool(e8m0[byte == 255].isnan().all())
    from deepinfer.backends.quant import round_scale_ue8m0

    assert torch.equal(pow2, round_scale_ue8m0(x.abs() + 1e-30))


# ------------------------------------------------------------------------------------------ activations


@pytest.mark.parametrize(
    ("m", "group", "ue8m0"), [(1, 128, False), (5, 32, True), (64, 128, True), (5, 7, False)]
)
def test_quant_fp8_group_is_bit_exact(cuda_ops, nan_outputs, m: int, group: int, ue8m0: bool) -> None:
    gen = torch.Generator().manual_seed(m + group)
    x = torch.randn(m, 300, generator=gen) * torch.logspace(-6, 2, 300)  # tiny groups hit the 1e-4 floor
    x[0, :group] = 0.0
    values, scale = cuda_ops.quant_fp8_group(x.to(DEVICE), group, ue8m0)
    want_values, want_scale = quantize_activations_fp8(x, group, ue8m0)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)
    if ue8m0:
        assert torch.equal(scale.cpu(), torch.exp2(torch.log2(scale.cpu()).round()))


def test_quant_fp8_group_reads_a_16_bit_row_view(cuda_ops) -> None:
    x = torch.randn(6, 2, 200).to(torch.float16)[:, 1]  # rows 400 elements apart
    values, scale = cuda_ops.quant_fp8_group(x.to(DEVICE), 128, True)
    want_values, want_scale = quantize_activations_fp8(x, 128, True)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


# ------------------------------------------------------------------------------------------ dense


def _fp8_weight(n: int, k: int, fmt: WeightFormat, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    # scale blocks differ by orders of magnitude, so a scale applied to the wrong block shows
    w = w * torch.logspace(-2, 1, n)[:, None].roll(seed % n, 0) * torch.logspace(1, -1, k)[None, :]
    return quantize_weight(w, fmt)


LINEAR_CASES = [  # (m, block, scale_fmt, dtype, native_fp8): every value of every axis at least once
    (1, 128, "f32", torch.float32, True),
    (5, 32, "ue8m0", torch.float16, True),
    (64, 128, "ue8m0", torch.float16, False),
    (5, 128, "f32", torch.float32, False),
    (1, 32, "f32", torch.float16, False),
    (64, 32, "f32", torch.float32, True),
]
ALL_LINEAR = [c for c in itertools.product([1, 5, 64], [128, 32], ["f32", "ue8m0"], DTYPES, [True, False])]


def _check_linear(m, block, scale_fmt, dtype, native, n=200, k=300, bias=True) -> None:
    fmt = WeightFormat("fp8", (block, block), scale_fmt)
    weight, scale = _fp8_weight(n, k, fmt, m + block)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    want = REF.fp8_linear(x, weight, scale, fmt.block, b)
    args = [t.to(DEVICE) for t in (x, weight, scale)]
    got = quant_linear.launch_block_scaled_gemm(
        args[0], None, args[1], args[2], fmt.block, None if b is None else b.to(DEVICE), dtype, native
    )
    assert got.dtype == dtype and got.shape == (m, n)
    assert _rel(got, want) < TOL[dtype], (m, block, scale_fmt, dtype, native)
    # W8A8 on the same weights, activations quantised as the model does (per K block of the weight)
    xq, xs = quantize_activations_fp8(x.float(), block, scale_fmt == "ue8m0")
    want8 = REF.fp8_linear_w8a8(xq, xs, weight, scale, fmt.block, b, dtype)
    got8 = quant_linear.launch_block_scaled_gemm(
        xq.to(DEVICE),
        xs.to(DEVICE),
        args[1],
        args[2],
        fmt.block,
        None if b is None else b.to(DEVICE),
        dtype,
        native,
    )
    assert _rel(got8, want8) < TOL[dtype], ("w8a8", m, block, scale_fmt, dtype, native)


@pytest.mark.parametrize(("m", "block", "scale_fmt", "dtype", "native"), LINEAR_CASES)
def test_block_scaled_linear(cuda_ops, nan_outputs, m, block, scale_fmt, dtype, native) -> None:
    """W8A16 and W8A8, both FP8 load paths, N = 200 and K = 300 (partial blocks in both)."""
    _check_linear(m, block, scale_fmt, dtype, native)


@pytest.mark.slow
@pytest.mark.parametrize(("m", "block", "scale_fmt", "dtype", "native"), ALL_LINEAR)
def test_block_scaled_linear_every_combination(
    cuda_ops, nan_outputs, m, block, scale_fmt, dtype, native
) -> None:
    _check_linear(m, block, scale_fmt, dtype, native)


def test_block_scaled_linear_4096_rows(cuda_ops, nan_outputs) -> None:
    _check_linear(4096, 32, "ue8m0", torch.float16, True, n=40, k=72, bias=False)


def test_ops_dispatch_and_deterministic_variants(cuda_ops, nan_outputs) -> None:
    """The registered ops (default and batch-invariant formulations) match the reference, and the W8A8
    op composes with this backend's quant_fp8_group as the model uses them."""
    fmt = WeightFormat("fp8", (128, 128), "ue8m0")
    weight, scale = _fp8_weight(136, 264, fmt, 3)
    x = torch.randn(7, 264)
    want = REF.fp8_linear(x, weight, scale, fmt.block, None)
    args = [t.to(DEVICE) for t in (x, weight, scale)]
    assert _rel(cuda_ops.fp8_linear(*args, fmt.block, None), want) < TOL[torch.float32]
    invariant = cuda_ops.deterministic_implementation("fp8_linear")
    assert invariant is not cuda_ops.implementation("fp8_linear")
    assert _rel(invariant(*args, fmt.block, None), want) < TOL[torch.float32]
    xq, xs = cuda_ops.quant_fp8_group(args[0], 128, True)
    want8 = REF.fp8_linear_w8a8(
        *quantize_activations_fp8(x, 128, True), weight, scale, fmt.block, None, torch.float32
    )
    got8 = cuda_ops.fp8_linear_w8a8(xq, xs, args[1], args[2], fmt.block, None, torch.float32)
    assert _rel(got8, want8) < TOL[torch.float32]
    invariant8 = cuda_ops.deterministic_implementation("fp8_linear_w8a8")
    assert (
        _rel(invariant8(xq, xs, args[1], args[2], fmt.block, None, torch.float32), want8) < TOL[torch.float32]
    )


def test_a_scale_applied_after_the_k_loop_is_caught() -> None:
    """The tolerance used here is far below the error of the classic bug (one scale for all K blocks),
    on the weights these tests use."""
    fmt = WeightFormat("fp8", (32, 32), "f32")
    weight, scale = _fp8_weight(200, 300, fmt, 1)
    x = torch.randn(5, 300)
    want = REF.fp8_linear(x, weight, scale, fmt.block, None)
    one_scale = scale[:, :1].expand_as(scale).contiguous()
    wrong = REF.fp8_linear(x, weight, one_scale, fmt.block, None)
    assert _rel(wrong, want) > 100 * TOL[torch.float16]


def test_linear_misuse_is_a_clear_error(cuda_ops) -> None:
    fmt = WeightFormat("fp8", (128, 128))
    weight, scale = (t.to(DEVICE) for t in _fp8_weight(130, 260, fmt, 0))
    x = torch.randn(3, 260, device=DEVICE)
    with pytest.raises(ValueError, match="columns"):
        cuda_ops.fp8_linear(x[:, :200], weight, scale, fmt.block, None)
    with pytest.raises(ValueError, match="scale has shape"):
        cuda_ops.fp8_linear(x, weight, scale, (32, 32), None)
    with pytest.raises(ValueError, match="needs values"):
        cuda_ops.fp8_linear(x, weight.float(), scale, fmt.block, None)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        cuda_ops.fp8_linear(x[None], weight, scale, fmt.block, None)
    xq, xs = cuda_ops.quant_fp8_group(x, 128, False)
    with pytest.raises(ValueError, match="activations"):
        cuda_ops.fp8_linear_w8a8(xq, xs[:, :1], weight, scale, fmt.block, None, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        cuda_ops.fp8_linear_w8a8(xq, xs, weight, scale, fmt.block, None, torch.int8)


def test_fp8_load_path_follows_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.ops_cuda.runtime import DeviceLimits

    for capability, native in [
        ((8, 0), False),
        ((8, 6), False),
        ((8, 9), True),
        ((9, 0), True),
        ((10, 0), True),
    ]:
        limits = DeviceLimits(sm_count=100, shared_memory=100 * 1024, capability=capability)
        monkeypatch.setattr(quant_linear, "device_limits", lambda device, limits=limits: limits)
        assert quant_linear.fp8_dot_supported(torch.device("cuda")) is native, capability


def test_gemm_config_keeps_block_k_inside_one_scale_block() -> None:
    for bk, block_k in [(128, 128), (32, 32), (64, 64), (256, 128), (96, 32), (100, 16), (8, 16)]:
        cfg = quant_linear.gemm_config(64, bk, 1, DEVICE)
        assert cfg.block_k == block_k, bk
        assert bk % cfg.block_k == 0 or cfg.block_k > bk or bk == 100
    assert quant_linear.gemm_config(1, 128, 2, DEVICE).block_m == 16
    assert quant_linear.gemm_config(4096, 128, 1, DEVICE).block_m == 128
    assert quant_linear.gemm_config(4096, 128, 1, DEVICE, block_m=32).block_m == 32


# ------------------------------------------------------------------------------------------ DeepGEMM


def test_deep_gemm_applies_only_where_it_is_exact() -> None:
    ok = dict(capability=(9, 0), block=(128, 128), out_dtype=torch.bfloat16, n=7168, k=7168)
    assert quant_linear.deep_gemm_applies(**ok)
    assert quant_linear.deep_gemm_applies(**{**ok, "out_dtype": torch.float32})
    for change in [
        {"capability": (10, 0)},  # SM100 re-rounds float32 scales to UE8M0
        {"capability": (8, 9)},
        {"block": (32, 32)},
        {"out_dtype": torch.float16},
        {"n": 7168 + 64},
        {"k": 7168 - 32},
    ]:
        assert not quant_linear.deep_gemm_applies(**{**ok, **change}), change


class _FakeDeepGemm:
    """Records the call and computes D = A @ B^T from the documented operand pairs."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def fp8_gemm_nt(self, a, b, d, c=None, recipe=None, disable_ue8m0_cast=False):
        self.calls.append({"a": a, "b": b, "recipe": recipe, "disable_ue8m0_cast": disable_ue8m0_cast})
        lhs = REF.fp8_linear_w8a8(a[0], a[1], b[0], b[1], (128, 128), None, torch.float32)
        d.copy_(lhs)


def test_deep_gemm_call_follows_its_documented_api() -> None:
    fmt = WeightFormat("fp8", (128, 128))
    weight, scale = _fp8_weight(256, 256, fmt, 2)
    x = torch.randn(3, 256)
    xq, xs = quantize_activations_fp8(x, 128, False)
    bias = torch.randn(256)
    fake = _FakeDeepGemm()
    got = quant_linear.deep_gemm_w8a8(fake, xq, xs, weight, scale, bias, torch.float32)
    (call,) = fake.calls
    assert call["recipe"] == (1, 128, 128) and call["disable_ue8m0_cast"] is True
    assert call["a"][0].dtype == torch.float8_e4m3fn and call["a"][1].dtype == torch.float32
    assert tuple(call["b"][1].shape) == (2, 2)
    want = REF.fp8_linear_w8a8(xq, xs, weight, scale, fmt.block, bias, torch.float32)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not ON_GPU, reason="DeepGEMM runs on an SM90 GPU")
def test_deep_gemm_matches_the_reference_where_installed() -> None:
    dg = quant_linear.deep_gemm_module()
    if dg is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("deep_gemm is not installed or this is not an SM90 GPU")
    fmt = WeightFormat("fp8", (128, 128))
    weight, scale = _fp8_weight(512, 1024, fmt, 4)
    xq, xs = quantize_activations_fp8(torch.randn(33, 1024), 128, False)
    want = REF.fp8_linear_w8a8(xq, xs, weight, scale, fmt.block, None, torch.float32)
    got = quant_linear.deep_gemm_w8a8(dg, *(t.cuda() for t in (xq, xs, weight, scale)), None, torch.bfloat16)
    assert _rel(got, want) < TOL[torch.bfloat16]


# ------------------------------------------------------------------------------------------ experts


FORMATS = {
    "fp8-128-f32": WeightFormat("fp8", (128, 128), "f32"),
    "fp8-32-ue8m0": WeightFormat("fp8", (32, 32), "ue8m0"),
    "mxfp4": WeightFormat("mxfp4", (1, 32), "ue8m0"),
}


def _experts(fmt: WeightFormat, e: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) * k**-0.5 * torch.logspace(-1, 1, n)[None, :, None]
    return quantize_weight(w, fmt)


MOE_CASES = [  # (format, tokens, dtype, native_fp8, D, I): I = 64 takes the one-scale-per-tile branch
    ("fp8-128-f32", 1, torch.float32, True, 100, 72),
    ("fp8-128-f32", 5, torch.float16, False, 136, 64),
    ("fp8-32-ue8m0", 5, torch.float32, False, 100, 72),
    ("fp8-32-ue8m0", 64, torch.float16, True, 72, 40),
    ("mxfp4", 1, torch.float16, True, 96, 160),
    ("mxfp4", 64, torch.float32, True, 64, 96),
]


@pytest.mark.parametrize(("name", "tokens", "dtype", "native", "d", "inter"), MOE_CASES)
def test_fused_moe_quant(cuda_ops, nan_outputs, monkeypatch, name, tokens, dtype, native, d, inter) -> None:
    """Both GEMMs (SwiGLU in the first epilogue, the router weight in the second) against the
    reference; some pairs belong to other ranks (id -1); intermediates are NaN-prefilled."""
    fmt = FORMATS[name]
    monkeypatch.setattr(quant_moe, "fp8_dot_supported", lambda device: native)
    experts, top_k = 6, 3
    w13, s13 = _experts(fmt, experts, 2 * inter, d, tokens)
    w2, s2 = _experts(fmt, experts, d, inter, tokens + 1)
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, d, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[0, -1] = -1
    weights = torch.rand(tokens, top_k, generator=gen)
    want = REF.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids)
    args = [t.to(DEVICE) for t in (hidden, w13, s13, w2, s2)]
    got = cuda_ops.fused_moe_quant(*args, fmt, weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == dtype and got.shape == (tokens, d)
    assert _rel(got, want) < TOL[dtype] * 4, name  # two GEMMs and a 16-bit intermediate
    invariant = cuda_ops.deterministic_implementation("fused_moe_quant")
    got_inv = invariant(*args, fmt, weights.to(DEVICE), ids.to(DEVICE))
    assert _rel(got_inv, want) < TOL[dtype] * 4, name


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("native", [True, False])
def test_grouped_gemm_quant(cuda_ops, nan_outputs, monkeypatch, name: str, native: bool) -> None:
    fmt = FORMATS[name]
    monkeypatch.setattr(quant_moe, "fp8_dot_supported", lambda device: native)
    k = 96 if fmt.kind == "mxfp4" else 100
    weight, scale = _experts(fmt, 4, 130, k, 7)
    sizes = torch.tensor([3, 0, 17, 1])
    x = torch.randn(int(sizes.sum()), k, generator=torch.Generator().manual_seed(1))
    want = REF.grouped_gemm_quant(x, weight, scale, fmt, sizes)
    got = cuda_ops.grouped_gemm_quant(*(t.to(DEVICE) for t in (x, weight, scale)), fmt, sizes.to(DEVICE))
    assert _rel(got, want) < TOL[torch.float32], name


def test_swapped_fp4_nibbles_would_be_caught() -> None:
    """The tolerance is far below what a swapped nibble order costs on these weights."""
    fmt = FORMATS["mxfp4"]
    weight, scale = _experts(fmt, 1, 64, 64, 0)
    swapped = (weight >> 4) | ((weight & 0xF) << 4)
    x = torch.randn(4, 64)
    sizes = torch.tensor([4])
    want = REF.grouped_gemm_quant(x, weight, scale, fmt, sizes)
    assert _rel(REF.grouped_gemm_quant(x, swapped, scale, fmt, sizes), want) > 100 * TOL[torch.float16]


def test_fused_moe_quant_with_every_expert_remote_is_zero(cuda_ops) -> None:
    fmt = FORMATS["fp8-32-ue8m0"]
    w13, s13 = _experts(fmt, 2, 64, 32, 0)
    w2, s2 = _experts(fmt, 2, 32, 32, 1)
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (torch.randn(3, 32), w13, s13, w2, s2)]
    out = cuda_ops.fused_moe_quant(*args, fmt, torch.ones(3, 2, device=DEVICE), ids.to(DEVICE))
    assert torch.equal(out.cpu(), torch.zeros(3, 32))


def test_expert_misuse_is_a_clear_error(cuda_ops) -> None:
    fmt = FORMATS["mxfp4"]
    w13, s13 = (t.to(DEVICE) for t in _experts(fmt, 2, 64, 64, 0))
    w2, s2 = (t.to(DEVICE) for t in _experts(fmt, 2, 64, 32, 1))
    hidden = torch.randn(3, 64, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="columns"):
        cuda_ops.fused_moe_quant(hidden[:, :32], w13, s13, w2, s2, fmt, weights, ids)
    with pytest.raises(ValueError, match="needs values"):
        cuda_ops.fused_moe_quant(hidden, w13, s13.float(), w2, s2, fmt, weights, ids)
    with pytest.raises(ValueError, match="group_sizes"):
        cuda_ops.grouped_gemm_quant(hidden, w13, s13, fmt, torch.tensor([3], device=DEVICE))
    with pytest.raises(ValueError, match="topk"):
        cuda_ops.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights[:, :1], ids)
    assert math.isfinite(float(cuda_ops.fused_moe_quant(hidden, w13, s13, w2, s2, fmt, weights, ids).sum()))


def test_the_invariant_tile_does_not_follow_the_row_count() -> None:
    fixed = {
        quant_linear.gemm_config(m, 128, 1, DEVICE, block_m=quant_linear.INVARIANT_BLOCK_M)
        for m in (1, 7, 4096)
    }
    assert len(fixed) == 1
    assert len({quant_linear.gemm_config(m, 128, 1, DEVICE) for m in (1, 4096)}) == 2


@pytest.mark.parametrize(("m", "k", "group"), [(4096, 48, 128), (24, 7168, 128), (3, 40, 32)])
def test_quant_fp8_group_tiles_rows_and_groups(cuda_ops, nan_outputs, m: int, k: int, group: int) -> None:
    """Tiles of several rows (many short rows) and of several groups (few long rows) write every element."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 10
    values, scale = cuda_ops.quant_fp8_group(x.to(DEVICE), group, True)
    want_values, want_scale = quantize_activations_fp8(x, group, True)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


def test_byte_decoded_and_float32_tiles_are_64_deep() -> None:
    assert quant_linear.gemm_config(4096, 128, 2, DEVICE, decode=True).block_k == 64
    assert quant_linear.gemm_config(4096, 128, 4, DEVICE).block_k == 64
    assert quant_linear.gemm_config(4096, 128, 1, DEVICE).block_k == 128
