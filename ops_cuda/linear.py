"""Dense projections: cuBLAS normally; in deterministic mode the grouped-GEMM kernel with one fixed
tile (cuBLAS picks kernels, tiles and split-K by the row count, so a row's bits depend on its batch).

A per-head projection ([T, H, K] by [H, N, K]) is a grouped GEMM whose groups are the heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.ops_cuda import OPS
from deepinfer.ops_cuda.grouped_gemm import INVARIANT_BLOCK_M, launch_grouped_gemm, tile_schedule
from deepinfer.ops_cuda.runtime import check_device


@OPS.implement
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if x.dim() == 3:
        if bias is not None:
            raise ValueError("linear: a per-head weight [H, N, K] takes no bias")
        return torch.einsum("thk,hnk->thn", x, weight)
    return F.linear(x, weight, bias)


@OPS.implement_invariant(
    f"the grouped-GEMM Triton kernel with one tile ({INVARIANT_BLOCK_M} rows, fixed BLOCK_N/BLOCK_K) for "
    "every row count, no split-K: each row's K loop runs in the same order"
)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: F811 (the mode's variant)
    check_device(x, weight)
    per_head = x.dim() == 3
    if per_head:
        if bias is not None:
            raise ValueError("linear: a per-head weight [H, N, K] takes no bias")
        tokens, heads, k = x.shape
        rows = x.transpose(0, 1).reshape(heads * tokens, k)
    else:
        tokens, heads = x.shape[0], 1
        rows, weight = x, weight[None]
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    sizes = torch.full((heads,), tokens, dtype=torch.int64, device=x.device)
    out = launch_grouped_gemm(
        rows, None, weight, tile_schedule(sizes, rows.shape[0], INVARIANT_BLOCK_M), rows.shape[0], False
    )
    if per_head:
        return out.view(heads, tokens, -1).transpose(0, 1)
    return out + bias if bias is not None else out
