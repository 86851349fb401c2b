"""Low-precision number formats as bit operations inside Triton kernels: e4m3 (FP8), e2m1 (FP4), e8m0.

Who uses it: the quantised-weight kernels (``quant_linear``, ``quant_moe``). The formats are defined in
``deepinfer.backends.quant``; these device functions reproduce its decoders and torch's float32 ->
float8_e4m3fn cast bit for bit, using only integer and float32 arithmetic, so that

- one kernel source runs on SM80/SM86, where Triton has no ``fp8e4nv`` type (the bytes are loaded as
  uint8 and decoded here), as well as on SM89+;
- the kernels behave the same under Triton's interpreter, whose own float32 -> fp8 cast is wrong (it
  drops the carry when rounding up crosses a power of two: 31.6 becomes 16, not 32; measured with
  triton 3.9), so no kernel here relies on ``.to(tl.float8e4nv)``.

No function here produces or reads a float32 subnormal on the normal path, so a GPU that flushes
subnormals computes the same values (the one exception is the e8m0 exponent 0, noted below).
"""

from __future__ import annotations

import triton
import triton.language as tl

# float32 bits of 2**14: adding it to |v| < 2**-6 rounds |v| to a multiple of 2**-9 (e4m3's subnormal
# step) with the hardware's round-to-nearest-even, and the low bits of the sum are that multiple.
_SUBNORMAL_MAGIC = tl.constexpr(16384.0)
_SUBNORMAL_MAGIC_BITS = tl.constexpr(0x46800000)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6
E4M3_SUBNORMAL_STEP = tl.constexpr(0.001953125)  # 2**-9


@triton.jit
def e4m3_encode(v):
    """float32 -> uint8 e4m3fn code, round to nearest even; exactly torch's ``.to(float8_e4m3fn)``
    for finite |v| <= 448 (callers clamp first, as DeepSeek's act_quant does)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Normal range: keep 3 of float32's 23 mantissa bits, round half to even (a carry rolls into the
    # exponent), then rebias the exponent from 127 to 7.
    rounded = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    subnormal = (mag + _SUBNORMAL_MAGIC).to(tl.uint32, bitcast=True) - _SUBNORMAL_MAGIC_BITS
    code = tl.where(mag < E4M3_MIN_NORMAL, subnormal, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(code):
    """uint8 e4m3fn code -> float32 value, exactly ``float8_e4m3fn.float()`` for every code but the
    two NaNs (0x7F / 0xFF decode to +-480; a weight or activation holding NaN is corrupt anyway)."""
    c = code.to(tl.int32)
    mag = c & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = mag.to(tl.float32) * E4M3_SUBNORMAL_STEP
    value = tl.where(mag < 8, subnormal, normal)
    return tl.where(c >= 128, -value, value)


@triton.jit
def e2m1_decode(nibble):
    """int32 e2m1 code (0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32 value
    (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives)."""
    mag = nibble & 7
    normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)  # 2**(e-1) * (1 + m/2)
    value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where(nibble >= 8, -value, value)


@triton.jit
def e8m0_to_float(exponent):
    """int32 e8m0 biased exponent (0..255) -> float32 ``2 ** (e - 127)``. e = 255 is NaN (the OCP MX
    encoding, as the reference decodes it); e = 0 is the float32 subnormal 2**-127 (flushed to zero on
    hardware that flushes subnormals; no real checkpoint scales a block that small)."""
    bits = tl.where(exponent == 0, 0x00400000, tl.where(exponent == 255, 0x7FC00000, exponent << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_up_pow2(scale):
    """Positive normal float32 -> the smallest power of two >= it (DeepSeek's ue8m0 rounding; exact
    powers of two stay)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)
    return (exponent << 23).to(tl.float32, bitcast=True)


__all__ = ["e2m1_decode", "e4m3_decode", "e4m3_encode", "e8m0_to_float", "round_up_pow2"]
