"""The numerical definition of the quantised weights (``deepinfer.backends.quant``) and the reference
quantised ops (``deepinfer.backends.reference.quant``), against independent oracles.

The oracles are written from the format specifications, not from the code under test: e4m3, e2m1 and
e8m0 decoded from their bit fields; block-scaled products as a slow loop over (N block, K block)
pairs in float64, each block dequantised on its own, multiplied and accumulated; the MoE as a loop
over tokens and their experts. Every conformance check compares a backend with the reference, so a
wrong reference would make every backend "conform" to the wrong thing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from deepinfer.backends import quant
from deepinfer.backends.quant import WeightFormat
from deepinfer.backends.reference import quant as ref
from deepinfer.backends.testing.checks import quantized_weight, random_routing
from deepinfer.backends.testing.harness import QUANT_FORMATS, format_id

FP8_FORMATS = [f for f in QUANT_FORMATS if f.kind == "fp8"]
MXFP4 = WeightFormat("mxfp4", (1, 32), "ue8m0")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ the formats, from their bit fields
def e4m3_from_bits(code: int) -> float:
    """OCP FP8 E4M3 ("fn": no infinities, S.1111.111 is NaN), exponent bias 7."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e2m1_from_bits(code: int) -> float:
    """OCP FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; no NaN or infinity."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def test_e4m3_values_decode_as_the_format_defines() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = codes.view(torch.float8_e4m3fn).float().tolist()
    for code, value in enumerate(got):
        want = e4m3_from_bits(code)
        assert (math.isnan(value) and math.isnan(want)) or value == want, (hex(code), value, want)
    assert max(v for v in got if not math.isnan(v)) == quant.FP8_MAX


def test_e2m1_table_and_nibble_order() -> None:
    assert list(quant.E2M1_VALUES) == [e2m1_from_bits(c) for c in range(16)]
    assert math.copysign(1.0, quant.E2M1_VALUES[8]) == -1.0  # code 8 is -0
    # byte j holds column 2j in its low nibble and 2j + 1 in its high nibble
    packed = torch.tensor([[0x21, 0xF7, 0x8C]], dtype=torch.uint8)
    assert quant.unpack_e2m1(packed).tolist() == [[0.5, 1.0, 6.0, -6.0, -2.0, -0.0]]
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    pairs = quant.unpack_e2m1(every_byte).view(256, 2)
    for byte in range(256):
        assert pairs[byte].tolist() == [e2m1_from_bits(byte & 0xF), e2m1_from_bits(byte >> 4)]


def test_e8m0_exponents_decode_to_powers_of_two() -> None:
    exponents = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    got = quant.e8m0_to_float(exponents)
    assert got.dtype == torch.float32
    assert got.tolist() == [math.ldexp(1.0, e - 127) for e in range(255)]  # 2**-127 (subnormal) included
    # 0xFF is NaN in OCP E8M0 (a corrupt scale must not pass as a huge finite or infinite one)
    assert math.isnan(float(quant.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))))


def test_mxfp4_dequantize_applies_each_groups_exponent() -> None:
    values = torch.randint(0, 256, (3, 64), generator=gen(1), dtype=torch.int32).to(torch.uint8)
    scale = torch.tensor([[127, 130, 120, 127], [0, 252, 127, 1], [126, 128, 129, 100]], dtype=torch.uint8)
    got = quant.dequantize(values, scale, MXFP4)
    for n in range(3):
        for k in range(128):
            byte = int(values[n, k // 2])
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            want = e2m1_from_bits(code) * math.ldexp(1.0, int(scale[n, k // 32]) - 127)
            assert float(got[n, k]) == want, (n, k)


def test_mxfp4_needs_k_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.dequantize(torch.zeros(4, 17, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), MXFP4)


# ------------------------------------------------------------------ ue8m0 rounding and act_quant
def test_ue8m0_rounds_up_to_a_power_of_two_and_keeps_exact_ones() -> None:
    powers = torch.tensor([2.0**e for e in range(-40, 40)])
    assert torch.equal(quant.round_scale_ue8m0(powers), powers)
    above = torch.nextafter(powers, torch.tensor(math.inf))
    below = torch.nextafter(powers, torch.tensor(0.0))
    assert torch.equal(quant.round_scale_ue8m0(above), powers * 2)
    assert torch.equal(quant.round_scale_ue8m0(below), powers)
    s = torch.rand(10_000, generator=gen(2)) * torch.exp2(torch.randint(-30, 30, (10_000,), generator=gen(3)))
    s = s.clamp(min=1e-30)
    r = quant.round_scale_ue8m0(s)
    mantissa, _ = torch.frexp(r)
    assert bool((mantissa == 0.5).all())
    assert bool((r >= s).all() and (r / 2 < s).all())


def act_quant_loop(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    """DeepSeek's act_quant, one row and one group at a time, from its definition."""
    m, k = x.shape
    cols = math.ceil(k / group)
    values = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, cols)
    for row in range(m):
        for col in range(cols):
            part = x[row, col * group : (col + 1) * group].float()
            s = torch.maximum(part.abs().max(), torch.tensor(1e-4)) / 448.0  # float32 arithmetic
            if ue8m0:
                mantissa, exponent = math.frexp(float(s))  # exact: s is a float32
                s = torch.tensor(math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent))
            scale[row, col] = s
            values[row, col * group : (col + 1) * group] = (
                (part / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            )
    return values, scale


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("group", [128, 32])
def test_act_quant_matches_the_loop_bit_for_bit(group: int, ue8m0: bool) -> None:
    g = gen(4)
    x = torch.randn(6, 200, generator=g) * torch.exp2(torch.randint(-8, 8, (6, 1), generator=g).float())
    x[0] = 0.0  # the 1e-4 amax floor
    x[1, :group] = 1e-7
    x[2, :group] *= 448 * 2**-5 / x[2, :group].abs().max()  # a power-of-two f32 scale
    x = x.to(torch.bfloat16)
    values, scale = ref.quant_fp8_group(x, group, ue8m0)
    want_values, want_scale = act_quant_loop(x, group, ue8m0)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    floor = torch.tensor(1e-4) / 448.0
    assert float(scale[0, 0]) == (2.0**-22 if ue8m0 else float(floor))  # 2**-23 < 1e-4 / 448 <= 2**-22
    assert float(scale[2, 0]) == 2.0**-5
    assert bool((values[0].float() == 0).all())


def test_act_quant_rows_do_not_depend_on_each_other() -> None:
    x = torch.randn(9, 100, generator=gen(5))
    values, scale = ref.quant_fp8_group(x, 32, True)
    for row in range(9):
        v, s = ref.quant_fp8_group(x[row : row + 1], 32, True)
        assert torch.equal(v.view(torch.uint8), values[row : row + 1].view(torch.uint8))
        assert torch.equal(s, scale[row : row + 1])


# ------------------------------------------------------------------ quantize_weight round trips
@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=format_id)
def test_fp8_round_trip(fmt: WeightFormat) -> None:
    n, k = 200, 328  # partial last blocks along both dims
    w = torch.randn(3, n, k, generator=gen(6)) * torch.exp2(
        torch.randint(-6, 6, (3, 1, 1), generator=gen(7)).float()
    )
    values, scale = quant.quantize_weight(w, fmt)
    assert values.shape == (3, n, k) and values.dtype == torch.float8_e4m3fn
    assert scale.shape == (3, *fmt.scale_shape(n, k)) and scale.dtype == torch.float32
    assert fmt.stored_bytes(n, k) == n * k + 4 * math.prod(fmt.scale_shape(n, k))
    back = quant.dequantize(values, scale, fmt)
    err = float((back - w).norm() / w.norm())
    assert err < (0.04 if fmt.scale_fmt == "f32" else 0.045), err
    # each block's amax lands on the format's largest value (f32) or in its top binade (ue8m0)
    bn, bk = fmt.block
    for nb in range(scale.shape[1]):
        for kb in range(scale.shape[2]):
            block = values[:, nb * bn : (nb + 1) * bn, kb * bk : (kb + 1) * bk].float().abs().amax(dim=(1, 2))
            if fmt.scale_fmt == "f32":
                assert bool((block == 448).all())
            else:
                assert bool((block >= 224).all() and (block <= 448).all())  # 224.0x rounds to 224
    if fmt.scale_fmt == "ue8m0":
        assert bool((torch.frexp(scale).mantissa == 0.5).all())


def test_mxfp4_round_trip_takes_the_nearest_code_under_the_smallest_scale() -> None:
    n, k = 40, 96
    w = torch.randn(2, n, k, generator=gen(8)) * torch.exp2(
        torch.randint(-10, 10, (2, n, 1), generator=gen(9)).float()
    )
    values, scale = quant.quantize_weight(w, MXFP4)
    assert values.shape == (2, n, k // 2) and values.dtype == torch.uint8
    assert scale.shape == (2, n, k // 32) and scale.dtype == torch.uint8
    assert MXFP4.stored_bytes(n, k) == n * k // 2 + n * k // 32
    s = quant.e8m0_to_float(scale).repeat_interleave(32, dim=-1)
    scaled = w / s
    # the exponent is the smallest whose group fits in +-6
    amax = w.abs().view(2, n, k // 32, 32).amax(dim=-1) / quant.e8m0_to_float(scale)
    assert bool((amax <= 6).all() and (amax > 3).all())
    # every element takes the nearest e2m1 value
    table = torch.tensor(quant.E2M1_VALUES[:8])
    nearest = (scaled.abs()[..., None] - table).abs().min(dim=-1).values
    back = quant.dequantize(values, scale, MXFP4)
    assert torch.allclose((back / s - scaled).abs(), nearest, atol=1e-6)
    err = float((back - w).norm() / w.norm())
    assert err < 0.2, err


# ------------------------------------------------------------------ the ops, against slow loops
def blocked_matmul(x: Tensor, values: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """float64 x [T, K] @ W.T for an fp8 pair: per (N block, K block), dequantise the block with its
    own scale, multiply, accumulate."""
    bn, bk = block
    n, k = values.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for nb in range(math.ceil(n / bn)):
        rows = slice(nb * bn, min(n, (nb + 1) * bn))
        for kb in range(math.ceil(k / bk)):
            cols = slice(kb * bk, min(k, (kb + 1) * bk))
            tile = values[rows, cols].double() * float(scale[nb, kb])
            out[:, rows] += x[:, cols].double() @ tile.t()
    return out


def mxfp4_matmul(x: Tensor, values: Tensor, scale: Tensor) -> Tensor:
    """float64 x [T, K] @ W.T for an mxfp4 pair, one 32-column group at a time, codes decoded from bits."""
    table = torch.tensor([e2m1_from_bits(c) for c in range(16)], dtype=torch.float64)
    n = values.shape[0]
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(n, -1).long()
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(codes.shape[1] // 32):
        cols = slice(32 * g, 32 * (g + 1))
        factor = torch.tensor([math.ldexp(1.0, int(e) - 127) for e in scale[:, g]], dtype=torch.float64)
        out += x[:, cols].double() @ (table[codes[:, cols]] * factor[:, None]).t()
    return out


def oracle_matmul(x: Tensor, values: Tensor, scale: Tensor, fmt: WeightFormat) -> Tensor:
    if fmt.kind == "mxfp4":
        return mxfp4_matmul(x, values, scale)
    return blocked_matmul(x, values, scale, fmt.block)


def rel(out: Tensor, want: Tensor) -> float:
    return float((out.double() - want).norm() / want.norm())


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=format_id)
def test_fp8_linear_reference_matches_the_block_loop(fmt: WeightFormat) -> None:
    g = gen(10)
    n, k = 136, 200
    values, scale = quantized_weight(g, (), n, k, fmt)
    x, bias = torch.randn(5, k, generator=g), torch.randn(n, generator=g)
    out = ref.fp8_linear(x, values, scale, fmt.block, bias)
    assert out.dtype == torch.float32 and out.shape == (5, n)
    assert rel(out, blocked_matmul(x, values, scale, fmt.block) + bias.double()) < 1e-5
    assert ref.fp8_linear(x.to(torch.bfloat16), values, scale, fmt.block, None).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=format_id)
def test_fp8_linear_w8a8_reference_matches_the_block_loop(fmt: WeightFormat) -> None:
    g = gen(11)
    n, k = 136, 200
    values, scale = quantized_weight(g, (), n, k, fmt)
    x_values, x_scale = act_quant_loop(torch.randn(5, k, generator=g), fmt.block[1], fmt.scale_fmt == "ue8m0")
    out = ref.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, None, torch.float32)
    # the activations' own blocks: 1 x bk, one scale per row and K block
    x = torch.cat(
        [x_values[:, kb * fmt.block[1] : (kb + 1) * fmt.block[1]].double() * x_scale[:, kb : kb + 1].double()
         for kb in range(x_scale.shape[1])], dim=1,
    )  # fmt: skip
    assert rel(out, blocked_matmul(x, values, scale, fmt.block)) < 1e-5
    half = ref.fp8_linear_w8a8(x_values, x_scale, values, scale, fmt.block, None, torch.bfloat16)
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", QUANT_FORMATS, ids=format_id)
def test_grouped_gemm_quant_reference_matches_the_loop(fmt: WeightFormat) -> None:
    g = gen(12)
    experts, n, k = 4, 72, 160
    values, scale = quantized_weight(g, (experts,), n, k, fmt)
    sizes = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, k, generator=g)
    out = ref.grouped_gemm_quant(x, values, scale, fmt, sizes)
    start, parts = 0, []
    for e, size in enumerate(sizes.tolist()):
        parts.append(oracle_matmul(x[start : start + size], values[e], scale[e], fmt))
        start += size
    assert rel(out, torch.cat(parts)) < 1e-5


@pytest.mark.parametrize("fmt", [QUANT_FORMATS[0], QUANT_FORMATS[3], MXFP4], ids=format_id)
def test_fused_moe_quant_reference_matches_the_token_loop(fmt: WeightFormat) -> None:
    g = gen(13)
    experts, top_k, d, inter = 5, 2, 160, 96
    w13, w13_scale = quantized_weight(g, (experts,), 2 * inter, d, fmt)
    w2, w2_scale = quantized_weight(g, (experts,), d, inter, fmt)
    tokens = 7
    hidden = torch.randn(tokens, d, generator=g)
    weights, ids = random_routing(g, tokens, experts, top_k)
    ids[2, 1] = -1  # another rank's expert: contributes nothing
    out = ref.fused_moe_quant(hidden, w13, w13_scale, w2, w2_scale, fmt, weights, ids)
    want = torch.zeros(tokens, d, dtype=torch.float64)
    for t in range(tokens):
        for slot in range(top_k):
            e = int(ids[t, slot])
            if e < 0:
                continue
            gate_up = oracle_matmul(hidden[t : t + 1], w13[e], w13_scale[e], fmt)
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            want[t] += float(weights[t, slot]) * oracle_matmul(act, w2[e], w2_scale[e], fmt)[0]
    assert rel(out, want) < 1e-5
