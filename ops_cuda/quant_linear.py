"""Block-scaled FP8 projections on NVIDIA GPUs: activation quantisation, W8A16 and W8A8 GEMMs.

Ops (semantics in ``deepinfer.backends.ops``, formats in ``deepinfer.backends.quant``):

- ``quant_fp8_group``: DeepSeek's act_quant, one program per tile of rows x groups; the e4m3 codes
  are computed by bit operations (``quant_codec.e4m3_encode``), bit-identical to the reference.
- ``fp8_linear`` (W8A16): x stays in its dtype; each weight tile is converted in registers, the
  ``tl.dot`` runs in x's dtype with a float32 accumulator, and each K block's partial product is
  multiplied by that block's weight scale inside the K loop (BLOCK_K divides the scale block bk).
- ``fp8_linear_w8a8``: per K block ``acc += dot(a, b) * sa[:, None] * sb[None, :]`` (float32
  accumulator; the dot of one block restarts from zero, the "promotion" DeepSeek's kernels do).

How the FP8 bytes become numbers is chosen per device capability at run time (``fp8_dot_supported``):
SM89 and later load them as ``float8_e4m3fn`` (the W8A8 dot multiplies FP8 on the tensor cores, the
W8A16 path converts with the hardware's cvt); SM80/SM86, which have no ``fp8e4nv`` type in Triton,
load them as uint8 and decode by bit operations, and the W8A8 dot then runs on float16 copies of
both operands (every e4m3 value is exact in float16, so the products are the same). Both paths are
the same kernels with a constexpr switch, and both run under Triton's interpreter.

DeepGEMM (``deep_gemm.fp8_gemm_nt``) serves ``fp8_linear_w8a8`` where it is importable and applies:
an SM90 device (which takes float32 scales as they are; SM100 would re-round them to UE8M0, which is
exact only for power-of-two scales, so SM100 runs the Triton kernel), 128x128 blocks, K and N
multiples of 128, bfloat16 or float32 output. It is never required.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer.backends.quant import FP8_DTYPE, WeightFormat, check_pair
from deepinfer.logger import get_logger
from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.quant_codec import e4m3_decode, e4m3_encode, round_up_pow2
from deepinfer.ops_cuda.runtime import check_device, device_limits, pipeline_stages, pow2

logger = get_logger(__name__)

# Outputs are allocated through this name (tests replace it with a NaN-filling allocator to prove that
# every element is written).
empty = torch.empty

INVARIANT_BLOCK_M = 32  # deterministic mode: one tile height whatever the row count
FP8_MAX = tl.constexpr(448.0)  # e4m3 max finite (a constexpr: kernels read it)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One launch configuration of the block-scaled GEMM kernels."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def fp8_dot_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` load FP8 as ``float8_e4m3fn`` (SM89+, and the interpreter) rather
    than as bytes decoded by bit operations (SM80/SM86)."""
    return device_limits(device).capability >= (8, 9)


def gemm_config(
    m: int,
    block_k_scale: int,
    operand_bytes: int,
    device: torch.device,
    block_m: int = 0,
    decode: bool = False,
    smem_bytes: tuple[float, float] | None = None,
) -> GemmConfig:
    """Tiles for an [m, K] x [N, K]^T block-scaled GEMM whose dot operands have ``operand_bytes`` per
    element: BLOCK_K divides the scale block (at most 128; 64 where FP8 is decoded by bit operations
    (``decode``) or the operands are float32, whose register tiles spill at 128 on SM80), BLOCK_M and
    BLOCK_N follow the row count (16 x 64 at decode, 128 x 128 for prefill) unless ``block_m`` fixes
    the tile (then BLOCK_N is 128 whatever the row count). Pipeline stages are sized by ``smem_bytes``:
    the shared memory per element of the A and W tiles (default: ``operand_bytes`` each)."""
    most_k = 64 if decode or operand_bytes == 4 else 128
    block_k = 16  # tl.dot needs K >= 16: a smaller scale block is masked inside the tile
    while block_k * 2 <= min(most_k, block_k_scale) and block_k_scale % (block_k * 2) == 0:
        block_k *= 2
    if block_m:  # a fixed tile (deterministic mode): nothing may follow the row count
        block_n = 128
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        block_n = 64 if m <= 16 else 128
    a_bytes, w_bytes = smem_bytes if smem_bytes is not None else (operand_bytes, operand_bytes)
    stage = int(block_k * (block_m * a_bytes + block_n * w_bytes))
    stages = pipeline_stages(device_limits(device), stage, reserved=block_m * block_n * 4, most=4)
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(block_m, block_n, block_k, 8, warps, stages)


@triton.jit
def _quant_fp8_group_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    num_groups,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """q[r, c] = e4m3(x[r, c] / s[r, g]) with s[r, g] = max(amax of group g of row r, 1e-4) / 448
    (rounded up to a power of two with UE8M0), for a [BLOCK_ROWS, GROUPS_PER_PROGRAM, GROUP] tile."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    within = tl.arange(0, GROUP_P2)
    cols = groups[None, :, None] * GROUP + within[None, None, :]
    group_ok = (rows < M)[:, None] & (groups < num_groups)[None, :]
    ok = group_ok[:, :, None] & (within < GROUP)[None, None, :] & (cols < K)
    row_off = rows.to(tl.int64)[:, None, None]
    x = tl.load(x_ptr + row_off * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), FP8_MAX)
    if UE8M0:
        scale = round_up_pow2(scale)
    v = tl.math.div_rn(x, scale[:, :, None])
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row_off * stride_q + cols, e4m3_encode(v), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_s + groups[None, :], scale, mask=group_ok)


# elements one quant_fp8_group program covers (rows x groups x group width), at most
_QUANT_TILE = 4096


@OPS.implement
def quant_fp8_group(x: Tensor, group: int, ue8m0: bool) -> tuple[Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"quant_fp8_group: x must be [M, K], got shape {tuple(x.shape)}")
    if group < 1:
        raise ValueError(f"quant_fp8_group: group must be positive, got {group}")
    check_device(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    values = empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = empty((m, num_groups), dtype=torch.float32, device=x.device)
    group_p2 = pow2(group)
    per_program = max(1, min(pow2(num_groups), _QUANT_TILE // group_p2))
    block_rows = max(1, min(pow2(m), _QUANT_TILE // (group_p2 * per_program)))
    if m and k:
        _quant_fp8_group_kernel[(triton.cdiv(m, block_rows), triton.cdiv(num_groups, per_program))](
            x,
            values.view(torch.uint8),
            scale,
            m,
            k,
            num_groups,
            x.stride(0),
            values.stride(0),
            scale.stride(0),
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK_ROWS=block_rows,
            GROUPS_PER_PROGRAM=per_program,
            UE8M0=bool(ue8m0),
            num_warps=4,
        )
    return values, scale


@triton.jit
def _load_fp8_as(ptrs, mask, NATIVE_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Load FP8 values (a float8_e4m3fn pointer with NATIVE_FP8, else a uint8 one) as DTYPE."""
    if NATIVE_FP8:
        values = tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
    else:
        values = e4m3_decode(tl.load(ptrs, mask=mask, other=0)).to(DTYPE)
    return values


@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cm,
    BN_SCALE: tl.constexpr,
    BK_SCALE: tl.constexpr,
    W8A8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALAR_W_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c = a @ dequant(w)^T (+ bias), a [M, K] high precision (W8A16) or FP8 with a per-(row, K block)
    scale (W8A8); w [N, K] FP8 with scale [ceil(N / BN_SCALE), ceil(K / BK_SCALE)]. Each scale block
    of K is BK_SCALE / BLOCK_K dots accumulated from zero, then scaled into the float32 accumulator."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the same weight columns together (L2 reuse).
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    if SCALAR_W_SCALE:
        w_scale_row = w_scale_ptr + (pid_n * BLOCK_N // BN_SCALE) * stride_wsn
    else:
        w_scale_rows = w_scale_ptr + (cols // BN_SCALE) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BK_SCALE)):
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for sub in tl.static_range(0, BK_SCALE, BLOCK_K):
            within = sub + tl.arange(0, BLOCK_K)
            kk = kb * BK_SCALE + within
            k_ok = (kk < K) & (within < BK_SCALE)
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
            if W8A8:
                a = _load_fp8_as(a_rows + kk[None, :], a_mask, NATIVE_FP8, DOT_DTYPE)
            else:
                a = tl.load(a_rows + kk[None, :], mask=a_mask, other=0.0)
            w = _load_fp8_as(w_rows + kk[None, :], w_mask, NATIVE_FP8, DOT_DTYPE)
            part = tl.dot(a, tl.trans(w), part, input_precision=PRECISION)
        if SCALAR_W_SCALE:
            part = part * tl.load(w_scale_row + kb)
        else:
            part = part * tl.load(w_scale_rows + kb, mask=col_ok, other=0.0)[None, :]
        if W8A8:
            part = part * tl.load(a_scale_ptr + rows * stride_asm + kb, mask=row_ok, other=0.0)[:, None]
        acc += part
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def launch_block_scaled_gemm(
    a: Tensor,
    a_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
    native_fp8: bool,
    block_m: int = 0,
) -> Tensor:
    """Run the block-scaled GEMM kernel; returns a new [M, N] tensor in ``out_dtype``.

    a: [M, K] float32/float16/bfloat16 (W8A16, ``a_scale`` None) or float8_e4m3fn with a_scale
    [M, ceil(K / bk)] float32 (W8A8); weight [N, K] float8_e4m3fn, weight_scale [ceil(N / bn),
    ceil(K / bk)] float32; ``native_fp8`` picks how FP8 is loaded (see the module docstring);
    ``block_m`` fixes the tile height (0: chosen from M). Shapes are not re-checked here."""
    m, k = a.shape
    n = weight.shape[0]
    bn, bk = block
    w8a8 = a_scale is not None
    if w8a8:
        dot_dtype = tl.float8e4nv if native_fp8 else tl.float16
        operand_bytes = 1 if native_fp8 else 2
    else:
        dot_dtype = _DOT_DTYPES[a.dtype]
        operand_bytes = a.element_size()
    # shared memory per element: the bytes as loaded, plus on SM80/SM86 (byte decode) the converted
    # copy they keep there; SM89+ hold converted tiles in registers (measured with
    # tests/nvidia/compile_check.py)
    decoded = 0 if native_fp8 else operand_bytes
    a_smem = (1 + decoded) if w8a8 else operand_bytes
    cfg = gemm_config(m, bk, operand_bytes, a.device, block_m, decode=not native_fp8,
                      smem_bytes=(a_smem, 1 + decoded))  # fmt: skip
    out = empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if native_fp8:
        a_arg = a
        w_arg = weight
    else:
        a_arg = a.view(torch.uint8) if w8a8 else a
        w_arg = weight.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _block_scaled_gemm_kernel[grid](
        a_arg,
        a_scale if w8a8 else weight_scale,
        w_arg,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0) if w8a8 else 0,
        weight.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        BN_SCALE=bn,
        BK_SCALE=bk,
        W8A8=w8a8,
        NATIVE_FP8=native_fp8,
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # tf32 is the default; fp32 must be exact
        SCALAR_W_SCALE=bn % cfg.block_n == 0,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check_linear(what: str, x: Tensor, weight: Tensor, weight_scale: Tensor, block, bias) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be [T, K], got shape {tuple(x.shape)}")
    check_pair(weight, weight_scale, WeightFormat("fp8", tuple(block)), f"{what} weight")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"{what}: x has {x.shape[1]} columns, the weight [N, K] = {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{what}: bias must be [{n}], got {tuple(bias.shape)}")
    return n, k


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, block, bias, block_m: int) -> Tensor:
    _check_linear("fp8_linear", x, weight, weight_scale, block, bias)
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"fp8_linear: x must be float32, float16 or bfloat16, got {x.dtype}")
    check_device(x, weight, weight_scale, *([] if bias is None else [bias]))
    native = fp8_dot_supported(x.device)
    return launch_block_scaled_gemm(
        _rows(x), None, _rows(weight), weight_scale.contiguous(), tuple(block), bias, x.dtype, native, block_m
    )


@OPS.implement
def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    return _fp8_linear(x, weight, weight_scale, block, bias, 0)


@OPS.implement_invariant(
    f"the block-scaled Triton kernel with one tile ({INVARIANT_BLOCK_M} rows, BLOCK_N/BLOCK_K fixed by the "
    "scale block) for every row count, no split-K: each row's K loop runs in the same order"
)
def fp8_linear(  # noqa: F811 (the mode's variant)
    x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> Tensor:
    return _fp8_linear(x, weight, weight_scale, block, bias, INVARIANT_BLOCK_M)


# ----------------------------------------------------------------------------------------- W8A8


def _check_w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype) -> None:
    _check_linear("fp8_linear_w8a8", x_values, weight, weight_scale, block, bias)
    check_pair(x_values, x_scale, WeightFormat("fp8", (1, block[1])), "fp8_linear_w8a8 activations")
    if out_dtype not in _DOT_DTYPES:
        raise ValueError(f"fp8_linear_w8a8: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    check_device(x_values, x_scale, weight, weight_scale, *([] if bias is None else [bias]))


def _w8a8_triton(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, block_m: int) -> Tensor:
    return launch_block_scaled_gemm(
        _rows(x_values),
        x_scale.contiguous(),
        _rows(weight),
        weight_scale.contiguous(),
        tuple(block),
        bias,
        out_dtype,
        fp8_dot_supported(x_values.device),
        block_m,
    )


@functools.cache
def deep_gemm_module() -> ModuleType | None:
    """DeepGEMM when it is importable and has the documented ``fp8_gemm_nt``, else None."""
    try:
        import deep_gemm  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not callable(getattr(deep_gemm, "fp8_gemm_nt", None)):
        logger.warning("deep_gemm is importable but has no fp8_gemm_nt; the Triton W8A8 kernel runs")
        return None
    return deep_gemm


_DEEP_GEMM_BROKEN: list[str] = []  # the first error DeepGEMM raised in this process, if any


def deep_gemm_applies(
    capability: tuple[int, int], block: tuple[int, int], out_dtype: torch.dtype, n: int, k: int
) -> bool:
    """Whether ``fp8_gemm_nt`` computes this W8A8 problem exactly as specified (see the module docstring)."""
    return (
        capability[0] == 9
        and tuple(block) == (128, 128)
        and out_dtype in (torch.bfloat16, torch.float32)
        and n % 128 == 0
        and k % 128 == 0
    )


def deep_gemm_w8a8(dg: ModuleType, x_values: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor,
                   bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:  # fmt: skip
    """``D = A @ B^T`` through DeepGEMM's NT FP8 GEMM: A = (x_values [M, K], x_scale [M, K/128] float32),
    B = (weight [N, K], weight_scale [N/128, K/128] float32), recipe (1, 128, 128), float32 scales kept
    as they are (``disable_ue8m0_cast``). DeepGEMM moves the LHS scale into its TMA-aligned, MN-major
    layout itself; the bias is added afterwards."""
    out = empty((x_values.shape[0], weight.shape[0]), dtype=out_dtype, device=x_values.device)
    dg.fp8_gemm_nt(
        (x_values.contiguous(), x_scale.float().contiguous()),
        (weight.contiguous(), weight_scale.float().contiguous()),
        out,
        recipe=(1, 128, 128),
        disable_ue8m0_cast=True,
    )
    return out + bias.to(out_dtype) if bias is not None else out


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
    _check_w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype)
    dg = deep_gemm_module() if x_values.device.type == "cuda" and not _DEEP_GEMM_BROKEN else None
    n, k = weight.shape
    if dg is not None and x_values.shape[0] and deep_gemm_applies(device_limits(x_values.device).capability,
                                                                  block, out_dtype, n, k):  # fmt: skip
        try:
            return deep_gemm_w8a8(dg, x_values, x_scale, weight, weight_scale, bias, out_dtype)
        except Exception as error:  # DeepGEMM compiles at run time: a missing nvcc surfaces here
            _DEEP_GEMM_BROKEN.append(f"{type(error).__name__}: {error}")
            logger.warning("deep_gemm.fp8_gemm_nt failed (%s); the Triton W8A8 kernel runs from now on",
                           _DEEP_GEMM_BROKEN[0])  # fmt: skip
    return _w8a8_triton(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, 0)


@OPS.implement_invariant(
    f"the block-scaled Triton kernel (never DeepGEMM) with one tile ({INVARIANT_BLOCK_M} rows) for every "
    "row count, no split-K"
)
def fp8_linear_w8a8(  # noqa: F811 (the mode's variant)
    x_values: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    block: tuple[int, int],
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    _check_w8a8(x_values, x_scale, weight, weight_scale, block, bias, out_dtype)
    return _w8a8_triton(x_values, x_scale, weight, weight_scale, block, bias, out_dtype, INVARIANT_BLOCK_M)
