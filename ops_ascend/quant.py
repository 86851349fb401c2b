"""Quantised weights on Ascend (issue 29): FP8 block-scaled and MXFP4 weights stay as stored in NPU
memory and are converted per call, per chip.

Chips (read from ``torch.npu.get_device_name``, the platform's chip table): A2 (910B) and A3 (910C,
910_93) have no FP8 datapath (torch_npu documents float8 matmul inputs for the 950 only); A5 (950PR /
950DT) multiplies FP8 with block or MX scales (``npu_quant_matmul``) and quantises activations
(``npu_dynamic_mx_quant``).

Per op:

- ``fp8_linear`` (W8A16, every chip): the weight is decoded from its bytes (``weight.view(uint8)`` and
  integer operations: no FP8 arithmetic, which A2/A3 lack), scaled by its block scales in float32 and
  cast to x's dtype one tile of rows at a time (at most ``TILE_ELEMENTS`` weights), then multiplied by a
  plain matmul (the cube unit in bfloat16 / float16). The 950's FP8 matmuls all quantise the activations
  (its weight-only FP8 modes take per-channel scales, which cannot hold block scales that vary along K),
  so W8A16 keeps this path there too.
- ``quant_fp8_group``: on a 950, for ue8m0 scales, bfloat16 / float16 x (float32 x with group 32) and a
  group that is a multiple of 32 up to 1024: ``npu_dynamic_mx_quant(x, dst_type=float8_e4m3fn,
  block_size=group, scale_alg=1, max_low_bound=1e-4)``, whose documented formula is DeepSeek's
  ``act_quant`` exactly (amax floored at 1e-4, / 448, exponent rounded up, zero-padded last group);
  otherwise the reference's torch code.
- ``fp8_linear_w8a8``: on a 950, block 128x128 runs the G-B mode of ``npu_quant_matmul`` (float32 block
  scales applied inside the K loop, ``group_sizes [1, 128, 128]``): exact for f32 (V3 / R1) and ue8m0
  scales alike. Other blocks with a K side that is a multiple of 32 (V4.1's 32x32) run the MX mode
  (``group_sizes [1, 1, 32]``, float8_e8m0fnu scales): each block scale's exponent is repeated along K
  (bk / 32 times) and N (bn times), which is exact only when every scale is a power of two. The weight's
  scales are checked once per weight tensor (cached with the MX scales derived from them) and the
  activation scales on every eager call (one host read); with a scale that is not a power of two, or
  during graph capture for a weight whose activations were never checked, the exact dequantise path
  below runs instead, logged once per reason. On A2 / A3 (and in that fallback) activations and weight
  are dequantised (x_values * x_scale; the weight as in ``fp8_linear``) and multiplied in out_dtype.
- ``grouped_gemm_quant`` / ``fused_moe_quant`` (every chip, FP8 and MXFP4 experts): the layer's experts
  are dequantised to the activations' dtype, a bounded tile of experts at a time, and run through this
  backend's ``grouped_gemm`` / ``fused_moe`` (``npu_grouped_matmul``, ``npu_moe_init_routing_v2``,
  ``npu_swiglu``, ``npu_moe_token_unpermute``). A layer's experts exist in bfloat16 only during the
  call (memory: one layer's experts in the activation dtype, transiently). The 950's MX grouped-matmul
  modes either quantise the activations (MxA8W8, A8W4: not W4A16 / W8A16) or need the weight repacked
  as float32 words of eight FP4 values, whose nibble order the documentation does not state; neither is
  used.

What emulation proves and what it cannot: tests/ascend run these paths against an emulation of the
torch_npu ops written from their documentation (shapes, dtypes, argument checks, formulas), so the
argument plumbing, layouts, scale re-expression, fallbacks and graph capture are checked on any host;
that the device kernels compute what their documentation says (rounding, the G-B / MX K-loop order,
saturation, the byte decoders' integer ops), that torch_npu holds float8 tensors on an A2 / A3 at all,
and how fast, only a 950 / A2 run can show (``tests/ascend/test_quant_on_device.py`` and the
conformance suite on the device, both run by ``ci/ascend.sh``).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.quant import (
    ACT_AMAX_FLOOR,
    FP8_DTYPE,
    MX_BLOCK,
    WeightFormat,
    check_pair,
    e8m0_to_float,
    expand_scale,
    logical_k,
    quantize_activations_fp8,
)
from deepinfer.logger import get_logger
from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.experts import fused_moe as npu_fused_moe
from deepinfer.ops_ascend.experts import grouped_gemm as npu_grouped_gemm
from deepinfer.ops_ascend.npu import torch_npu

logger = get_logger(__name__)

A5_CHIPS = frozenset({"ascend950pr", "ascend950dt"})
# Weights decoded to float32 at once (bounds the transient memory of the dequantise paths: 64 MiB).
TILE_ELEMENTS = 1 << 24
GB_BLOCK = (128, 128)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------- chips


@functools.cache
def chip() -> str:
    """The chip-table key of NPU 0 (``deepinfer.platform.chips``), from ``torch.npu.get_device_name``
    (read once per process: every NPU of a host is the same chip; ``chip.cache_clear()`` re-reads)."""
    from deepinfer.platform.ascend import chip_from_device_name

    torch_npu()  # importing torch_npu creates torch.npu
    name = torch.npu.get_device_name(0)
    key = chip_from_device_name(name)
    if key is None:
        raise RuntimeError(f"unrecognised Ascend device {name!r}: cannot tell whether it multiplies FP8")
    return key


def multiplies_fp8() -> bool:
    """Whether this NPU has FP8 matmuls (Ascend 950PR / 950DT); A2 / A3 have none."""
    return chip() in A5_CHIPS


# ------------------------------------------------------------------------------------------- decoding


def e4m3_to_float(values: Tensor) -> Tensor:
    """float8_e4m3fn [...] -> float32 [...], decoded from the bytes with integer and float32 operations
    only: ``(8 + m) * 2**(e - 10)`` for exponent e > 0, ``m * 2**-9`` for e == 0, NaN for 0x7F / 0xFF."""
    bits = values.view(torch.uint8).to(torch.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    significand = torch.where(exponent > 0, mantissa + 8, mantissa).float()
    magnitude = torch.ldexp(significand, exponent.clamp(min=1) - 10)
    magnitude = torch.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def e2m1_to_float(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] holding two e2m1 codes (low nibble = even column) -> float32 [..., K]:
    ``(2 + m) * 2**(e - 2)`` for exponent e > 0, ``m / 2`` for e == 0, sign in bit 3."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int32)
    exponent = (codes >> 1) & 0x3
    mantissa = codes & 0x1
    significand = torch.where(exponent > 0, mantissa + 2, mantissa).float()
    magnitude = torch.ldexp(significand, exponent.clamp(min=1) - 2)
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize_to(values: Tensor, scale: Tensor, fmt: WeightFormat, dtype: torch.dtype) -> Tensor:
    """A quantised [..., N, K] pair -> ``dtype`` [..., N, K] (``quant.dequantize``, decoded from the bytes),
    one tile of at most ``TILE_ELEMENTS`` weights at a time. Stacked matrices (experts) whose N is a
    multiple of the block's (always for MXFP4) are decoded as one [E * N, K] matrix: a few large tiles,
    not one launch sequence per expert."""
    check_pair(values, scale, fmt)
    n, k = values.shape[-2], logical_k(values, fmt)
    out = torch.empty((*values.shape[:-2], n, k), dtype=dtype, device=values.device)
    if n % fmt.block[0] == 0:
        _dequantize_rows(
            values.reshape(-1, values.shape[-1]), scale.reshape(-1, scale.shape[-1]), fmt, out.view(-1, k)
        )
    else:
        flat_values, flat_scale = (
            values.reshape(-1, n, values.shape[-1]),
            scale.reshape(-1, *scale.shape[-2:]),
        )
        for m, matrix in enumerate(out.view(-1, n, k)):
            _dequantize_rows(flat_values[m], flat_scale[m], fmt, matrix)
    return out


def _dequantize_rows(values: Tensor, scale: Tensor, fmt: WeightFormat, out: Tensor) -> None:
    """One [N, K] matrix into ``out``, a tile of whole row blocks at a time."""
    n, k = out.shape
    bn = fmt.block[0]
    rows = max(bn, TILE_ELEMENTS // max(k, 1) // bn * bn)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        if fmt.kind == "fp8":
            tile = e4m3_to_float(values[n0:n1])
            tile = tile * expand_scale(scale[n0 // bn : math.ceil(n1 / bn)], fmt.block, n1 - n0, k)
        else:
            tile = e2m1_to_float(values[n0:n1])
            tile = tile * e8m0_to_float(scale[n0:n1]).repeat_interleave(MX_BLOCK, dim=-1)
        out[n0:n1] = tile.to(out.dtype)


# ------------------------------------------------------------------------------------------- checks


def _require_float(t: Tensor, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {t.dtype}")


def check_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None, op: str
) -> WeightFormat:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be [N, K], got shape {tuple(weight.shape)}")
    fmt = WeightFormat("fp8", tuple(block))
    check_pair(weight, weight_scale, fmt, f"{op} weight")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[1]} columns, the weight K={weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [N={weight.shape[0]}], got shape {tuple(bias.shape)}")
    return fmt


def _linear_dequantized(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, bias: Tensor | None
) -> Tensor:
    """``x @ W.T (+ bias)`` in x's dtype, W decoded to x's dtype one row tile at a time."""
    n, k = weight.shape
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    bn = fmt.block[0]
    rows = max(bn, TILE_ELEMENTS // max(k, 1) // bn * bn)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = dequantize_to(weight[n0:n1], weight_scale[n0 // bn : math.ceil(n1 / bn)], fmt, x.dtype)
        out[:, n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1].to(x.dtype))
    return out


# ------------------------------------------------------------------------------------------- dense


@OPS.implement
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    _require_float(x, "fp8_linear: x")
    fmt = check_linear(x, weight, weight_scale, block, bias, "fp8_linear")
    return _linear_dequantized(x, weight, weight_scale, fmt, bias)


@OPS.implement
def quant_fp8_group(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    if group < 1:
        raise ValueError(f"quant_fp8_group: group must be positive, got {group}")
    if x.dim() != 2:
        raise ValueError(f"quant_fp8_group: x must be [M, K], got shape {tuple(x.shape)}")
    _require_float(x, "quant_fp8_group: x")
    if ue8m0 and _mx_quant_fits(x, group) and multiplies_fp8():
        values, mxscale = torch_npu().npu_dynamic_mx_quant(
            x,
            axis=-1,
            round_mode="rint",
            dst_type=FP8_DTYPE,
            block_size=group,
            scale_alg=1,
            max_low_bound=ACT_AMAX_FLOOR,
        )
        groups = math.ceil(x.shape[1] / group)
        return values, e8m0_to_float(mxscale.reshape(x.shape[0], -1)[:, :groups])
    return quantize_activations_fp8(x, group, ue8m0)


def _mx_quant_fits(x: Tensor, group: int) -> bool:
    """npu_dynamic_mx_quant's documented limits: block a multiple of 32 in (0, 1024]; float32 input
    only with block 32 and at least 32 columns."""
    if group % MX_BLOCK or group > 1024 or x.shape[0] == 0:
        return False
    return x.dtype != torch.float32 or (group == MX_BLOCK and x.shape[1] >= MX_BLOCK)


class _WeightScales:
    """Per weight-scale tensor (a weak reference and its version, as ``host.host_list``): whether every
    scale is a power of two, its MX (1x32) re-expression, and whether an eager call has seen its
    activations with power-of-two scales (so a graph capture may take the MX path)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Tensor], int, dict[str, object]]] = {}

    def get(self, scale: Tensor) -> dict[str, object]:
        entry = self._entries.get(id(scale))
        if entry is not None and entry[0]() is scale and entry[1] == scale._version:
            return entry[2]
        for key in [k for k, (ref, _, _) in self._entries.items() if ref() is None]:
            del self._entries[key]
        info: dict[str, object] = {}
        self._entries[id(scale)] = (weakref.ref(scale), scale._version, info)
        return info


_weight_scales = _WeightScales()
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("ops_ascend fp8_linear_w8a8: %s", reason)


def _exponent_bits(scale: Tensor) -> Tensor:
    """float32 scales -> int32 biased exponents (the e8m0 byte of a power of two)."""
    return (scale.contiguous().view(torch.int32) >> 23) & 0xFF


def _powers_of_two(scale: Tensor) -> bool:
    """Whether every float32 scale is a positive normal power of two (reads one bool to the host)."""
    bits = scale.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return bool((((bits & 0x7FFFFF) == 0) & (exponent > 0) & (exponent < 255) & (bits > 0)).all())


def _mx_scale(exponents: Tensor, bk: int, k: int) -> Tensor:
    """Block exponents [R, ceil(k / bk)] -> MX scales uint8 [R, ceil(k / 64), 2]: one per 32 columns
    (the block's exponent repeated bk / 32 times), the count padded to even with 0."""
    per32 = math.ceil(k / MX_BLOCK)
    index = torch.arange(per32, device=exponents.device) * MX_BLOCK // bk
    out = torch.zeros(
        (exponents.shape[0], 2 * math.ceil(per32 / 2)), dtype=torch.uint8, device=exponents.device
    )
    out[:, :per32] = exponents[:, index].to(torch.uint8)
    return out.view(exponents.shape[0], -1, 2)


def _capturing() -> bool:
    torch_npu()
    return bool(torch.npu.is_current_stream_capturing())


@OPS.implement
def fp8_linear_w8a8(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    fmt = check_linear(x_values, weight, weight_scale, block, bias, "fp8_linear_w8a8")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"fp8_linear_w8a8: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    check_pair(x_values, x_scale, WeightFormat("fp8", (1, block[1])), "fp8_linear_w8a8 activations")
    if multiplies_fp8():
        if tuple(block) == GB_BLOCK:
            return _gb_matmul(x_values, x_scale, weight, weight_scale, bias, out_dtype)
        if block[1] % MX_BLOCK == 0:
            mx_weight = _mx_weight_scale(weight_scale, tuple(block), weight.shape[0], weight.shape[1])
            if mx_weight is not None and _mx_activations_ok(x_scale, weight_scale):
                return _mx_matmul(x_values, x_scale, weight, mx_weight, block[1], bias, out_dtype)
        else:
            _warn_once(f"block {tuple(block)}: the K side is not a multiple of 32 (no MX mode); dequantising")
    x = (e4m3_to_float(x_values) * expand_scale(x_scale, (1, block[1]), *x_values.shape)).to(out_dtype)
    return _linear_dequantized(x, weight, weight_scale, fmt, bias)


def _gb_matmul(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """npu_quant_matmul's G-B mode: x (m, k) with float32 (m, ceil(k/128)) scales, the weight as a
    transposed (k, n) view with its (ceil(k/128), ceil(n/128)) scales transposed alike; no bias in this
    mode (added after, in float32)."""
    out = torch_npu().npu_quant_matmul(
        x_values.contiguous(),
        weight.t(),
        weight_scale.t(),
        pertoken_scale=x_scale.contiguous(),
        output_dtype=torch.float32,
        group_sizes=[1, 128, 128],
    )
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _mx_weight_scale(weight_scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor | None:
    """The weight's MX scales uint8 [n, ceil(k/64), 2] (cached per scale tensor), or None when some
    block scale is not a power of two (logged once)."""
    info = _weight_scales.get(weight_scale)
    if "mx" not in info:
        if _powers_of_two(weight_scale):
            rows = _exponent_bits(weight_scale).repeat_interleave(block[0], dim=0)[:n]
            info["mx"] = _mx_scale(rows, block[1], k)
        else:
            info["mx"] = None
    if info["mx"] is None:
        _warn_once(
            f"block {block} weight scales that are not powers of two (f32 scales) have no exact MX (1x32) "
            "form on this chip; dequantising the weight instead"
        )
    return info["mx"]


def _mx_activations_ok(x_scale: Tensor, weight_scale: Tensor) -> bool:
    """Whether x_scale holds powers of two (ue8m0 activation quantisation). Checked on eager calls;
    during graph capture (no host reads) trusted only if an eager call with this weight saw them so."""
    info = _weight_scales.get(weight_scale)
    if _capturing():
        if not info.get("activations_ue8m0", False):
            _warn_once("graph capture before any eager call checked the activation scales; dequantising")
            return False
        return True
    if not _powers_of_two(x_scale):
        _warn_once(
            "activation scales that are not powers of two (quant_fp8_group with ue8m0=False) have no exact "
            "MX form; dequantising"
        )
        info["activations_ue8m0"] = False
        return False
    info["activations_ue8m0"] = True
    return True


def _mx_matmul(
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    mx_weight: Tensor,
    bk: int,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """npu_quant_matmul's MX mode (group_sizes [1, 1, 32], float8_e8m0fnu scales): the weight as a
    transposed (k, n) view with its (n, ceil(k/64), 2) scales transposed alike to (ceil(k/64), n, 2)."""
    npu = torch_npu()
    k = x_values.shape[1]
    mx_x = _mx_scale(_exponent_bits(x_scale), bk, k)
    out = npu.npu_quant_matmul(
        x_values.contiguous(),
        weight.t(),
        mx_weight.transpose(0, 1),
        pertoken_scale=mx_x,
        bias=None if bias is None else bias.float(),
        output_dtype=torch.float32,
        scale_dtype=npu.float8_e8m0fnu,
        pertoken_scale_dtype=npu.float8_e8m0fnu,
        group_sizes=[1, 1, MX_BLOCK],
    )
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------- experts


def check_experts(weight: Tensor, scale: Tensor, fmt: WeightFormat, what: str) -> None:
    if weight.dim() != 3:
        raise ValueError(f"{what} must be [E, N, K] (mxfp4: [E, N, K/2]), got shape {tuple(weight.shape)}")
    check_pair(weight, scale, fmt, what)


@OPS.implement
def grouped_gemm_quant(
    x: Tensor, weight: Tensor, weight_scale: Tensor, fmt: WeightFormat, group_sizes: Tensor
) -> Tensor:
    _require_float(x, "grouped_gemm_quant: x")
    check_experts(weight, weight_scale, fmt, "grouped_gemm_quant weight")
    if x.dim() != 2 or x.shape[1] != logical_k(weight, fmt):
        raise ValueError(
            f"grouped_gemm_quant: x must be [rows, K={logical_k(weight, fmt)}], got shape {tuple(x.shape)}"
        )
    if tuple(group_sizes.shape) != (weight.shape[0],):
        raise ValueError(
            f"grouped_gemm_quant: group_sizes must be [E={weight.shape[0]}], got {tuple(group_sizes.shape)}"
        )
    return npu_grouped_gemm(x, dequantize_to(weight, weight_scale, fmt, x.dtype), group_sizes)


@OPS.implement
def fused_moe_quant(
    hidden: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    fmt: WeightFormat,
    topk_weights: Tensor,
    topk_ids: Tensor,
) -> Tensor:
    _require_float(hidden, "fused_moe_quant: hidden")
    check_experts(w13, w13_scale, fmt, "fused_moe_quant w13")
    check_experts(w2, w2_scale, fmt, "fused_moe_quant w2")
    d, inter2 = logical_k(w13, fmt), w13.shape[1]
    if hidden.dim() != 2 or hidden.shape[1] != d:
        raise ValueError(f"fused_moe_quant: hidden must be [T, D={d}], got shape {tuple(hidden.shape)}")
    if w2.shape[0] != w13.shape[0] or w2.shape[1] != d or 2 * logical_k(w2, fmt) != inter2:
        raise ValueError(
            f"fused_moe_quant: w2 must be [E={w13.shape[0]}, D={d}, I={inter2 // 2}] for w13 "
            f"[E, 2I={inter2}, D], got {tuple(w2.shape)} (values)"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"fused_moe_quant: topk_ids / topk_weights must both be [T={hidden.shape[0]}, k], got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    w13_d = dequantize_to(w13, w13_scale, fmt, hidden.dtype)
    w2_d = dequantize_to(w2, w2_scale, fmt, hidden.dtype)
    return npu_fused_moe(hidden, w13_d, w2_d, topk_weights, topk_ids)


# ------------------------------------------------------------------------------------------- deterministic mode

OPS.declare_invariant(
    ["quant_fp8_group"],
    "npu_dynamic_mx_quant's documented formula works per row and per group (one amax, one power-of-two "
    "scale, casts), as does the reference's torch code it otherwise runs",
)
