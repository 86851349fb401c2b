"""DeepSeek routing, grouped GEMM and the fused routed-expert MLP: native kernels (``csrc/moe.cpp``).

- ``moe_route``: one pass per token (scores, bias, group ranking, group mask, top-k, weights) instead of
  about fifteen torch ops. Experts and groups are selected by torch's own CPU top-k procedure (the same
  standard-library selection with the same comparator), so ties resolve as the reference's do.
- ``fused_moe``: every (token, expert) pair through the expert's weights read in place; no weight
  gather, no argsort, no loop over experts in Python and no host synchronisation. An expert with fewer
  than ``MM_ROWS`` rows runs the skinny products of ``csrc/skinny.h`` (the native ``linear``'s) on its
  gathered rows, parallel over (expert, block of output columns), so two threads share even one token's
  experts; an expert with more runs as one ``at::mm`` per matrix
  over its gathered rows (MKL; float32 only, unless the CPU has native bf16: see ``mm_rows``). Each
  token's k expert outputs are added in float32 in slot order.
- ``grouped_gemm``: the same two paths over rows already grouped by expert (the large one multiplies
  each group's rows in place).

``_grouped`` (``torch._grouped_mm`` over expert-sorted rows) remains for deterministic mode's padded
grouped products (``deterministic.py``), whose invariance rests on MKL's tiled row counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import cpu_has_bf16, load

_native = load()

# An expert with at least this many rows in a call is multiplied by at::mm on its gathered rows; fewer go
# through the skinny products. Measured on fused_moe alone (the bundled model's experts, D 192, I 64, 16
# experts, top 4, fp32, 2 threads, every expert on one path, best of 5): 16 rows per expert 294 us skinny
# against 426 at::mm; 32 rows 732 against 554; 64 rows 1,380 against 1,000-1,100. Decode batches sit near
# or below it (64 requests: 8-27 rows per expert), prefill chunks far above (2048 tokens: about 512).
MM_ROWS = 24
# Without native bf16 arithmetic (AVX-512 BF16 / AMX), at::mm in 16-bit types measured 4-37x slower than
# the kernel at every row count (1-128 rows per expert): such calls never take the at::mm path.
_NEVER = 1 << 62
_MM_DTYPES = (torch.float32, torch.bfloat16) if cpu_has_bf16() else (torch.float32,)


def mm_rows(dtype: torch.dtype) -> int:
    """Rows per expert from which ``fused_moe`` / ``grouped_gemm`` use at::mm for weights of ``dtype``."""
    return MM_ROWS if dtype in _MM_DTYPES else _NEVER


_ALIGN_BYTES = 16


def _grouped(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """``out[r] = weight[e(r)] @ x[r]`` for expert-sorted rows with group ends ``offs`` ([E] int32) through
    ``torch._grouped_mm``, which needs row strides that are multiples of 16 bytes (an odd inner width is
    zero padded, which is exact); [N, Nout]."""
    inner = x.shape[1]
    align = _ALIGN_BYTES // x.element_size()
    if inner % align:
        pad = align - inner % align
        x, weight = F.pad(x, (0, pad)), F.pad(weight, (0, pad))
    return torch._grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offs)


@OPS.implement
def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    return _native.moe_route(
        router_logits, correction_bias, top_k, n_group, topk_group, scoring_func, topk_method, renormalize,
        routed_scaling_factor,
    )  # fmt: skip


@OPS.implement
def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    return _native.grouped_gemm(x, weight, group_sizes, mm_rows(x.dtype))


@OPS.implement
def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    return _native.fused_moe(hidden, w13, w2, topk_weights, topk_ids, mm_rows(hidden.dtype))


OPS.declare_invariant(
    ["moe_route"],
    "native kernel: each token's row is scored, ranked and normalised by the same scalar code, alone, "
    "whatever the other rows of the call or the thread that runs it",
)
