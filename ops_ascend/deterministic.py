"""Deterministic (batch-invariant) mode on Ascend: what torch_npu's documentation says per op, and
where this backend therefore routes an op to an invariant formulation.

torch_npu's op documentation (``torch_npu/_op_plugin_docs.py``, 2.13.0) states batch invariance for none
of the kernels this backend calls; it says "确定性计算" (deterministic computation: same bits run to
run for the same input) only for ``npu_moe_token_unpermute``, which is not the same property (a kernel
may be run-to-run deterministic yet tile differently, and so round differently, when the batch
changes). Hence, per op:

- elementwise kernels with no reduction, invariant by their documented formula, kept:
  ``npu_swiglu`` (silu_and_mul), ``npu_rotary_mul`` (rope); copies kept: ``npu_scatter_pa_kv_cache``
  (kv_cache_write), ``index_select`` (kv_cache_gather);
- kernels with a reduction whose tiling the documentation does not pin, routed to the reference's
  invariant formulation (plain torch on the NPU, one reduction per row / row counts in whole tiles):
  ``npu_rms_norm`` / ``npu_add_rms_norm``, ``npu_moe_gating_top_k`` (moe_route), ``npu_grouped_matmul``
  (grouped_gemm, fused_moe, with ``npu_moe_init_routing_v2`` and ``npu_moe_token_unpermute``), FIA v2 TND
  (mla_prefill; deterministic mode does not call it);
- the FIA MLA decode kernel, replaced below by the fixed-split formulation over this backend's own
  two-tensor cache (the reference's code cannot read that layout);
- linear, ep_dispatch / ep_combine and apply_token_bitmask already run the reference implementation;
  sample runs our own per-row kernel (or its torch fallback).

What is proven where: on a CPU host the formulations run against the test emulation; that the torch
operations they use (matmul over one shape, row reductions) are batch-invariant on the NPU itself is
a claim only an Ascend runner can check (``ci/ascend.sh`` runs the invariance checks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepinfer.backends.reference.invariant import KV_SPLIT, split_kv_attention
from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.host import host_list

UNDOCUMENTED = "torch_npu's documentation does not state batch invariance for"

OPS.declare_invariant(["silu_and_mul"], "npu_swiglu: elementwise, no reduction")
OPS.declare_invariant(["rope"], "npu_rotary_mul: elementwise, no reduction")
OPS.declare_invariant(["kv_cache_spec", "kv_cache_write", "kv_cache_gather"], "layout and row copies")
OPS.declare_invariant(
    ["sample"], "our own per-row kernel (or the reference's torch code): counter-based noise per row"
)
OPS.declare_variant(["rms_norm", "add_rms_norm"], f"{UNDOCUMENTED} npu_rms_norm / npu_add_rms_norm")
OPS.declare_variant(["moe_route"], f"{UNDOCUMENTED} npu_moe_gating_top_k")
OPS.declare_variant(["grouped_gemm"], f"{UNDOCUMENTED} npu_grouped_matmul (tiles follow the group sizes)")
OPS.declare_variant(
    ["fused_moe"], f"{UNDOCUMENTED} npu_grouped_matmul; npu_moe_token_unpermute is documented run-to-run only"
)
OPS.declare_variant(["mla_prefill"], f"{UNDOCUMENTED} npu_fused_infer_attention_score_v2 (TND)")


@OPS.implement_invariant(
    f"{UNDOCUMENTED} the FIA MLA kernel: replaced by fixed splits of {KV_SPLIT} keys "
    "(the reference's formulation: row counts padded to whole tiles, splits added in ascending order) "
    "over this backend's latent and rope caches (torch on the NPU)"
)
def mla_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    kv_cache: Sequence[Tensor],
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    latent, rope = kv_cache
    lens = host_list(seq_lens)
    queries = torch.cat((q_nope, q_pe), dim=-1).float()  # the key's order: latent, then rope
    out = split_kv_attention(
        queries, (latent.view(-1, latent.shape[-1]), rope.view(-1, rope.shape[-1])), block_table,
        latent.shape[1], lens, host_list(query_start_loc), q_nope.shape[-1], scale, sliding_window,
    )  # fmt: skip
    return out.to(q_nope.dtype)
