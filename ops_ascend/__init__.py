"""Ascend backend (``DEEPINFER_ACCELERATOR=ascend``): the op interface on torch_npu and Ascend C.

Importing this package fills ``OPS`` without importing ``torch_npu`` (``deepinfer.ops_ascend.npu``
imports it at the first op call), so the registry and the layout tests can load the table on any host.

Modules: ``norm`` (npu_rms_norm, npu_add_rms_norm, npu_swiglu), ``rope`` (npu_rotary_mul), ``cache``
(the two-tensor paged cache, npu_scatter_pa_kv_cache), ``prefill`` / ``decode`` (FIA v2 TND, FIA MLA),
``routing`` (npu_moe_gating_top_k), ``experts`` (npu_moe_init_routing_v2, npu_grouped_matmul,
npu_swiglu, npu_moe_token_unpermute), ``sampling`` (the Ascend C kernel from ``csrc`` or torch),
``graph`` (updating captured attention lengths), ``deterministic`` (per op, what torch_npu's documentation
says about batch invariance and where deterministic mode routes an op instead), ``quant`` (FP8 block-scaled
and MXFP4 weights kept as stored: W8A16 by per-tile dequantisation on every chip, FP8 matmuls and
activation quantisation on the 950 via npu_quant_matmul / npu_dynamic_mx_quant) with its deterministic
formulations in ``quant_invariant``, plus shared helpers (``fia``, ``host``, ``native``).
``ep_dispatch`` / ``ep_combine`` run the reference's torch.distributed exchange (all_to_all_single, on the
HCCL group here), and portable ops their reference implementation; activation logs each such op.
"""

from deepinfer.backends.registry import OpTable

OPS = OpTable("deepinfer.ops_ascend")

from deepinfer.ops_ascend import (  # noqa: E402  (submodules register into OPS)
    cache,
    decode,
    deterministic,
    experts,
    norm,
    prefill,
    quant,
    quant_invariant,
    rope,
    routing,
    sampling,
)

OPS.use_reference_for(
    ["linear"],
    reason="dense projections are torch matmuls on the NPU (aclnn); deterministic mode runs the reference's "
    "one-GEMM-shape formulation",
)
OPS.use_reference_for(
    ["ep_dispatch", "ep_combine"],
    reason="expert-parallel exchange is all_to_all_single over the HCCL group (the reference's torch.distributed "
    "code, run on the NPU); the MC2 npu_moe_distribute_dispatch_v2/combine_v2 decode path is not implemented",
)


def _length_updater():
    """Graph sessions for the model runner: captured FIA calls get their host lengths updated."""
    from deepinfer.ops_ascend.graph import AttentionLengthUpdater

    return AttentionLengthUpdater()


OPS.graph_session = _length_updater

__all__ = [
    "OPS",
    "cache",
    "decode",
    "deterministic",
    "experts",
    "norm",
    "prefill",
    "quant",
    "quant_invariant",
    "rope",
    "routing",
    "sampling",
]
