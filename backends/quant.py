"""Low-precision weight formats as data: how a quantised weight is stored, and its exact decoding.

Who uses it: the loader (``deepinfer.model.loader``) reads a checkpoint's ``quantization_config`` into
``WeightFormat`` values and keeps each quantised weight as a ``(values, scale)`` pair in that format;
the op interface (``deepinfer.backends.ops``: ``fp8_linear``, ``fp8_linear_w8a8``,
``grouped_gemm_quant``, ``fused_moe_quant``) consumes the pairs; the reference backend and the
conformance suite use the decoders here as the numerical definition of each format. Everything here
is plain, device-generic torch: the tensors stay on whatever device they are on.

Formats (``WeightFormat.kind``):

- ``"fp8"``: DeepSeek's block-scaled FP8. Values ``float8_e4m3fn`` [..., N, K]; scale float32
  [..., ceil(N / bn), ceil(K / bk)] for ``block = (bn, bk)`` (128x128 for V3 to V4, 32x32 for V4.1);
  ``W[n, k] = values[n, k] * scale[n // bn, k // bk]``. The last block of a dimension that is not a
  multiple of the block is partial. With ``scale_fmt == "ue8m0"`` every scale is a power of two (the
  checkpoint stores ``float8_e8m0fnu``; it is kept as float32 holding the same value).
- ``"mxfp4"``: OCP MX FP4 as V4 ships its routed experts. Values e2m1, two per byte, in uint8
  [..., N, K / 2]: byte ``j`` holds column ``2j`` in its low nibble and column ``2j + 1`` in its high
  nibble; scale uint8 [..., N, K / 32] holding e8m0 biased exponents: ``W[n, k] = e2m1(values[n, k //
  2] nibble) * 2 ** (scale[n, k // 32] - 127)``. K must be a multiple of 32. ``block`` is ``(1, 32)``.

Activation quantisation (``quantize_activations_fp8``, DeepSeek's ``act_quant``): per row and per
group of ``group`` columns, ``scale = max(amax, 1e-4) / 448``, rounded up to ``2 ** ceil(log2(scale))``
when ``ue8m0``; values ``x / scale`` cast to ``float8_e4m3fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# DeepSeek's act_quant clamps the group amax at 1e-4 (kernel.py); so do we, exactly.
ACT_AMAX_FLOOR = 1e-4
MX_BLOCK = 32
E8M0_BIAS = 127

# e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

WeightKind = Literal["fp8", "mxfp4"]
ScaleFmt = Literal["f32", "ue8m0"]


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How one quantised weight is stored (see the module docstring for each kind's layout).

    Created by the loader from ``config.json`` ``quantization_config`` (one for dense weights, one for
    routed experts when ``expert_dtype`` differs); read by the model layers and the quantised ops.
    """

    kind: WeightKind
    block: tuple[int, int]
    scale_fmt: ScaleFmt = "f32"

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "mxfp4"):
            raise ValueError(f"weight format kind must be 'fp8' or 'mxfp4', got {self.kind!r}")
        if self.scale_fmt not in ("f32", "ue8m0"):
            raise ValueError(f"scale_fmt must be 'f32' or 'ue8m0', got {self.scale_fmt!r}")
        if len(self.block) != 2 or any(int(b) != b or b < 1 for b in self.block):
            raise ValueError(f"block must be two positive integers, got {self.block!r}")
        if self.kind == "mxfp4" and (tuple(self.block) != (1, MX_BLOCK) or self.scale_fmt != "ue8m0"):
            raise ValueError(
                f"mxfp4 has one ue8m0 scale per 1x{MX_BLOCK}; got block {self.block}, {self.scale_fmt}"
            )

    @property
    def name(self) -> str:
        if self.kind == "mxfp4":
            return "mxfp4"
        return f"fp8 {self.block[0]}x{self.block[1]} {self.scale_fmt}"

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The scale grid of an [n, k] weight (logical k: unpacked columns)."""
        return math.ceil(n / self.block[0]), math.ceil(k / self.block[1])

    def values_shape(self, n: int, k: int) -> tuple[int, int]:
        """The stored values' shape of an [n, k] weight."""
        if self.kind == "mxfp4":
            if k % MX_BLOCK:
                raise ValueError(f"mxfp4 needs K a multiple of {MX_BLOCK}, got {k}")
            return n, k // 2
        return n, k

    @property
    def values_dtype(self) -> torch.dtype:
        return FP8_DTYPE if self.kind == "fp8" else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.kind == "fp8" else torch.uint8

    def stored_bytes(self, n: int, k: int) -> int:
        """Bytes an [n, k] weight takes in this format (values plus scales)."""
        vn, vk = self.values_shape(n, k)
        sn, sk = self.scale_shape(n, k)
        return vn * vk + sn * sk * (4 if self.kind == "fp8" else 1)


def check_pair(values: Tensor, scale: Tensor, fmt: WeightFormat, what: str = "weight") -> None:
    """Raise ValueError naming ``what`` unless (values, scale) is a valid [..., N, K] pair of ``fmt``."""
    if values.dtype != fmt.values_dtype or scale.dtype != fmt.scale_dtype:
        raise ValueError(
            f"{what}: {fmt.name} needs values {fmt.values_dtype} and scale {fmt.scale_dtype}, "
            f"got {values.dtype} and {scale.dtype}"
        )
    if values.shape[:-2] != scale.shape[:-2]:
        raise ValueError(f"{what}: values {tuple(values.shape)} and scale {tuple(scale.shape)} disagree")
    n, stored_k = values.shape[-2:]
    k = stored_k * 2 if fmt.kind == "mxfp4" else stored_k
    if fmt.kind == "mxfp4" and k % MX_BLOCK:
        raise ValueError(f"{what}: mxfp4 needs K a multiple of {MX_BLOCK}, got {k} ({stored_k} bytes a row)")
    if tuple(scale.shape[-2:]) != fmt.scale_shape(n, k):
        raise ValueError(
            f"{what}: scale has shape {tuple(scale.shape[-2:])}, expected {fmt.scale_shape(n, k)} for a "
            f"{n}x{k} weight in {fmt.block[0]}x{fmt.block[1]} blocks"
        )


def logical_k(values: Tensor, fmt: WeightFormat) -> int:
    """The unpacked column count K of stored values [..., N, K or K/2]."""
    return values.shape[-1] * 2 if fmt.kind == "mxfp4" else values.shape[-1]


def expand_scale(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """Scale grid [..., ceil(n/bn), ceil(k/bk)] -> float32 [..., n, k], each block's scale repeated."""
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :k]


def e8m0_to_float(exponents: Tensor) -> Tensor:
    """uint8 e8m0 biased exponents -> float32 ``2 ** (e - 127)``; 0xFF is NaN (OCP MX)."""
    ones = torch.ones(exponents.shape, dtype=torch.float32, device=exponents.device)
    scale = torch.ldexp(ones, exponents.int() - E8M0_BIAS)
    return scale.masked_fill(exponents == 0xFF, float("nan"))


def unpack_e2m1(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] (low nibble first) -> float32 [..., K] e2m1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    low = (packed & 0xF).long()
    high = (packed >> 4).long()
    return torch.stack((table[low], table[high]), dim=-1).flatten(-2)


def dequantize(values: Tensor, scale: Tensor, fmt: WeightFormat) -> Tensor:
    """A quantised [..., N, K] pair -> float32 [..., N, K] (the definition every kernel must match)."""
    check_pair(values, scale, fmt)
    if fmt.kind == "fp8":
        n, k = values.shape[-2:]
        return values.float() * expand_scale(scale, fmt.block, n, k)
    w = unpack_e2m1(values)
    return w * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


def round_scale_ue8m0(scale: Tensor) -> Tensor:
    """Round positive float32 scales up to the next power of two (exact on powers of two)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))


def quantize_weight(weight: Tensor, fmt: WeightFormat) -> tuple[Tensor, Tensor]:
    """float [..., N, K] -> (values, scale) in ``fmt``: per-block absmax scaling to the format's range
    (±448 for e4m3, ±6 for e2m1 with the exponent rounded up so no value clips). Used to write
    quantised checkpoints (``tools/quantize_fp8.py``) and by tests."""
    lead, (n, k) = weight.shape[:-2], weight.shape[-2:]
    w = weight.float().reshape(-1, n, k)
    if fmt.kind == "mxfp4":
        fmt.values_shape(n, k)  # validates K
        groups = w.view(w.shape[0], n, k // MX_BLOCK, MX_BLOCK)
        amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS).int()
        scaled = groups / torch.ldexp(torch.ones_like(amax), exponent)[..., None]
        codes = _nearest_e2m1_code(scaled.reshape(w.shape[0], n, k))
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return packed.reshape(*lead, n, k // 2), (exponent + E8M0_BIAS).to(torch.uint8).reshape(*lead, n, -1)
    bn, bk = fmt.block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = w.new_zeros(w.shape[0], rows * bn, cols * bk)
    padded[:, :n, :k] = w
    tiles = padded.view(w.shape[0], rows, bn, cols, bk)
    scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX
    if fmt.scale_fmt == "ue8m0":
        scale = round_scale_ue8m0(scale)
    values = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    values = values.view(w.shape[0], rows * bn, cols * bk)[:, :n, :k]
    return values.reshape(*lead, n, k).contiguous(), scale.reshape(*lead, rows, cols)


def _nearest_e2m1_code(x: Tensor) -> Tensor:
    """float32 values in [-6, 6] -> int64 e2m1 codes, round to nearest (ties to the even code)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    distance = (x.abs()[..., None] - magnitudes).abs()
    # argmin takes the first minimum; nudging odd codes breaks ties toward even mantissas.
    distance = distance + torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], device=x.device) * 1e-7
    code = distance.argmin(dim=-1)
    return torch.where(x < 0, code | 8, code)


def quantize_activations_fp8(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    """x [M, K] float -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K/group)]): DeepSeek's
    ``act_quant`` (see the module docstring), the reference of the ``quant_fp8_group`` op."""
    if x.dim() != 2:
        raise ValueError(f"quant_fp8_group: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    cols = math.ceil(k / group)
    padded = x.float().new_zeros(m, cols * group)
    padded[:, :k] = x.float()
    groups = padded.view(m, cols, group)
    scale = groups.abs().amax(dim=-1).clamp(min=ACT_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = round_scale_ue8m0(scale)
    values = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, cols * group)
    return values[:, :k].contiguous(), scale
