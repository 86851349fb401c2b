"""Emulated quantisation ops, from their documentation (torch_npu's ``npu_dynamic_mx_quant`` and
``npu_quant_matmul`` pages, Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu``, 950 editions; the CANN
``aclnnQuantMatmulV5`` page for the G-B / MX formulas), for the arguments deepinfer passes; anything else
raises "not emulated".

- Chip support: both ops take FP8 only on Ascend 950PR / 950DT (``npu_dynamic_mx_quant`` lists 950 only;
  ``npu_quant_matmul`` on A2/A3 takes int8 / int32 inputs only), so on an emulated A2/A3 device an FP8
  call raises, as the device would.
- ``npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=float4_e2m1fn_x2, block_size=32,
  scale_alg=0, dst_type_max=0.0, max_low_bound=0.0)``: emulated for ``dst_type`` float8_e4m3fn /
  float8_e5m2 with ``scale_alg=1`` along the last axis. Per block of ``block_size`` values (a partial last
  block is zero padded): ``amax = max(|v|)``, raised to ``max_low_bound`` when that is positive;
  ``S = amax / Amax(dst)`` (448 for e4m3fn, 57344 for e5m2); its float32 biased exponent ``E`` is raised
  by one when S is normal, ``E < 254`` and its mantissa is non-zero (or S is subnormal with mantissa
  above one half); the block's scale is ``2 ** (E - 127)``, returned as its e8m0 byte ``E``; values are
  ``cast(v * (1 / scale))`` with rint. ``input`` is float16 / bfloat16 (any multiple of 32 up to 1024)
  or float32 (block 32 only, last dimension at least 32). ``mxscale`` is uint8 with one more dimension
  than ``input``: ``[..., ceil(ceil(K / block_size) / 2), 2]``, the block count padded to even with 0.
- ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
  x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
  y_scale=None)``: emulated for float8 x1 (m, k) and x2 (k, n) (x2 contiguous or a transposed view of
  (n, k)) in two modes of the 950 table:
  * G-B, ``group_sizes [1, 128, 128]``: ``pertoken_scale`` float32 (m, ceil(k/128)), ``scale`` float32
    (ceil(k/128), ceil(n/128)) with x2's transposition, no bias;
  * MX, ``group_sizes [1, 1, 32]``: ``scale_dtype`` and ``pertoken_scale_dtype`` float8_e8m0fnu (uint8
    storage), ``pertoken_scale`` (m, ceil(k/64), 2), ``scale`` (ceil(k/64), n, 2) with x2's
    transposition (a transposed view of (n, ceil(k/64), 2)), bias None or float32 (n,) / (1, n).
  ``out[m, n] = sum_j (x1[m, Kj] . x2[Kj, n]) * pertoken_scale[m, j] * scale[j, n / gsN] (+ bias[n])``
  over K slices ``Kj`` of ``gsK`` columns (the last may be partial), computed in float32 here;
  ``output_dtype`` float16 / bfloat16 / float32 (the default int8 is not emulated).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tests.ascend.emulation.runtime import device_name, npu_op


class NpuDtype:
    """A torch_npu-only dtype constant (``torch_npu.float8_e8m0fnu`` ...): passed as ``*_dtype`` to say
    how an 8-bit tensor's bytes are to be read."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name}"


float8_e8m0fnu = NpuDtype("float8_e8m0fnu")
float4_e2m1fn_x2 = NpuDtype("float4_e2m1fn_x2")
hifloat8 = NpuDtype("hifloat8")
DTYPES = {"float8_e8m0fnu": float8_e8m0fnu, "float4_e2m1fn_x2": float4_e2m1fn_x2, "hifloat8": hifloat8}

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise RuntimeError(f"{op}: {message}")


def _on_950() -> bool:
    return "950" in device_name().upper()


def _e8m0(exponents: Tensor) -> Tensor:
    """uint8 e8m0 bytes -> float32 2 ** (e - 127)."""
    return torch.pow(2.0, exponents.to(torch.int32).float() - 127.0)


@npu_op
def npu_dynamic_mx_quant(
    input: Tensor,  # the documented argument name
    *,
    axis: int = -1,
    round_mode: str = "rint",
    dst_type: object = float4_e2m1fn_x2,
    block_size: int = 32,
    scale_alg: int = 0,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
) -> tuple[Tensor, Tensor]:
    op = "npu_dynamic_mx_quant"
    _require(_on_950(), op, f"supported on Ascend 950PR / 950DT only, not on {device_name()}")
    _require(
        input.dtype in (torch.float16, torch.bfloat16, torch.float32), op, "input is float16/bfloat16/float32"
    )
    _require(1 <= input.dim() <= 7, op, "input has 1 to 7 dimensions")
    _require(axis in (-1, input.dim() - 1), op, "only the last axis is emulated")
    _require(dst_type in FP8_TYPES, op, "only float8 destinations are emulated")
    _require(round_mode == "rint", op, "float8 destinations take round_mode 'rint' only")
    _require(scale_alg == 1, op, "only scale_alg 1 is emulated")
    _require(
        block_size % 32 == 0 and 0 < block_size <= 1024, op, "block_size is a multiple of 32 in (0, 1024]"
    )
    k = input.shape[-1]
    if input.dtype == torch.float32:
        _require(block_size == 32 and k >= 32, op, "float32 input takes block_size 32 and an axis of >= 32")
    _require(dst_type_max == 0.0, op, "dst_type_max applies to float4_e2m1fn_x2 only")
    _require(max_low_bound >= 0.0, op, "max_low_bound is non-negative")
    blocks = math.ceil(k / block_size)
    padded = torch.zeros((*input.shape[:-1], blocks * block_size), dtype=torch.float32)
    padded[..., :k] = input.float()
    grouped = padded.view(*input.shape[:-1], blocks, block_size)
    amax = grouped.abs().amax(dim=-1)
    if max_low_bound > 0:
        amax = torch.maximum(amax, torch.tensor(max_low_bound, dtype=torch.float32))
    s = (amax / FP8_MAX[dst_type]).contiguous()
    bits = s.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = ((exponent > 0) & (exponent < 254) & (mantissa > 0)) | ((exponent == 0) & (mantissa > (1 << 22)))
    exponent = exponent + up.to(torch.int32)
    scale = _e8m0(exponent)
    y = (grouped * (1.0 / scale)[..., None]).view(*input.shape[:-1], -1)[..., :k].to(dst_type)
    pairs = math.ceil(blocks / 2)
    mxscale = torch.zeros((*input.shape[:-1], pairs * 2), dtype=torch.uint8)
    mxscale[..., :blocks] = exponent.to(torch.uint8)
    return y, mxscale.view(*input.shape[:-1], pairs, 2)


def _layouts(t: Tensor, dims: tuple[int, int]) -> set[str]:
    """The layouts ``t`` has: "nd" (contiguous) and / or "t" (a transposed view: ``dims`` swapped is
    contiguous); a tensor with size-1 dimensions can have both."""
    found = {"nd"} if t.is_contiguous() else set()
    return found | ({"t"} if t.transpose(*dims).is_contiguous() else set())


@npu_op
def npu_quant_matmul(
    x1: Tensor,
    x2: Tensor,
    scale: Tensor,
    *,
    offset: Tensor | None = None,
    pertoken_scale: Tensor | None = None,
    bias: Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    x1_dtype: object = None,
    x2_dtype: object = None,
    pertoken_scale_dtype: object = None,
    scale_dtype: object = None,
    group_sizes: list[int] | None = None,
    y_scale: Tensor | None = None,
) -> Tensor:
    op = "npu_quant_matmul"
    if x1.dtype in FP8_TYPES or x2.dtype in FP8_TYPES:
        _require(
            _on_950(), op, f"float8 inputs are supported on Ascend 950PR / 950DT only, not on {device_name()}"
        )
    _require(x1.dtype in FP8_TYPES and x2.dtype in FP8_TYPES, op, "only float8 x1 / x2 are emulated")
    _require(offset is None and y_scale is None and x1_dtype is None and x2_dtype is None, op, "not emulated")
    _require(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], op, "x1 (m, k) and x2 (k, n)")
    _require(x1.is_contiguous(), op, "x1 must not be transposed (not emulated)")
    x2_layouts = _layouts(x2, (0, 1))
    _require(bool(x2_layouts), op, "x2 contiguous or a transposed view")
    _require(
        output_dtype in (torch.float16, torch.bfloat16, torch.float32),
        op,
        "output_dtype float16/bfloat16/float32",
    )
    _require(pertoken_scale is not None, op, "the G-B and MX modes take pertoken_scale")
    m, k = x1.shape
    n = x2.shape[1]
    if list(group_sizes or []) == [1, 128, 128]:
        _require(scale_dtype is None and pertoken_scale_dtype is None, op, "G-B takes float32 scales")
        _require(
            scale.dtype == torch.float32 and pertoken_scale.dtype == torch.float32,
            op,
            "G-B scales are float32",
        )
        kb = math.ceil(k / 128)
        _require(
            tuple(pertoken_scale.shape) == (m, kb), op, f"G-B pertoken_scale is (m, ceil(k/128)) = {(m, kb)}"
        )
        _require(
            tuple(scale.shape) == (kb, math.ceil(n / 128)), op, "G-B scale is (ceil(k/128), ceil(n/128))"
        )
        _require(bool(_layouts(scale, (0, 1)) & x2_layouts), op, "scale transposed like x2")
        _require(bias is None, op, "G-B with float8 inputs takes no bias")
        x_scale, w_scale = pertoken_scale, scale.repeat_interleave(128, dim=1)[:, :n]
        block = 128
    elif list(group_sizes or []) == [1, 1, 32]:
        _require(
            scale_dtype is float8_e8m0fnu and pertoken_scale_dtype is float8_e8m0fnu, op, "MX scales are e8m0"
        )
        _require(
            scale.dtype == torch.uint8 and pertoken_scale.dtype == torch.uint8, op, "e8m0 in 8-bit storage"
        )
        k64 = math.ceil(k / 64)
        _require(
            tuple(pertoken_scale.shape) == (m, k64, 2),
            op,
            f"MX pertoken_scale is (m, ceil(k/64), 2) = {(m, k64, 2)}",
        )
        _require(tuple(scale.shape) == (k64, n, 2), op, f"MX scale is (ceil(k/64), n, 2) = {(k64, n, 2)}")
        _require(bool(_layouts(scale, (0, 1)) & x2_layouts), op, "scale transposed like x2")
        _require(
            bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) in ((n,), (1, n))),
            op,
            "MX bias is None or float32 (n,) / (1, n)",
        )
        x_scale = _e8m0(pertoken_scale.reshape(m, -1))
        w_scale = _e8m0(scale.permute(0, 2, 1).reshape(-1, n))
        block = 32
    else:
        raise RuntimeError(
            f"{op}: group_sizes {group_sizes} not emulated (G-B [1, 128, 128] or MX [1, 1, 32])"
        )
    a, b = x1.float(), x2.float()
    out = torch.zeros((m, n), dtype=torch.float32)
    for j in range(math.ceil(k / block)):
        cols = slice(j * block, min(k, (j + 1) * block))
        out += (a[:, cols] @ b[cols]) * x_scale[:, j : j + 1] * w_scale[j][None, :]
    if bias is not None:
        out = out + bias.reshape(1, n)
    return out.to(output_dtype)
