"""NVIDIA backend (``DEEPINFER_ACCELERATOR=nvidia``): every interface op as Triton kernels.

Activation imports this package, which fills ``OPS`` as its modules are imported. One source serves
SM80, SM90 and SM100: launch configurations follow the device's limits (``runtime``). The kernels also
run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the conformance
suite checks them on a host without a GPU (float32/float16; the interpreter mishandles bfloat16).
"""

from deepinfer.backends.registry import OpTable

OPS = OpTable("deepinfer.ops_cuda")

from deepinfer.ops_cuda import (  # noqa: E402  (modules register into OPS)
    activation,
    cache,
    ep,
    grouped_gemm,
    linear,
    mla_decode,
    mla_prefill,
    moe,
    norm,
    quant_linear,
    quant_moe,
    rope,
    routing,
    sampling,
    token_mask,
)

OPS.declare_invariant(
    ["rms_norm", "add_rms_norm"], "one program per row, block size fixed by the hidden size"
)
OPS.declare_invariant(["silu_and_mul", "rope", "apply_token_bitmask"], "elementwise per row")
OPS.declare_invariant(["kv_cache_spec", "kv_cache_write", "kv_cache_gather"], "layout and row copies")
OPS.declare_invariant(
    ["moe_route"], "each token routed in its own lanes; the block shape follows the expert count only"
)
OPS.declare_invariant(["sample"], "one program per row; counter-based noise")
OPS.declare_invariant(
    ["quant_fp8_group"],
    "each (row, group) amax and scale computed from that row's group alone, no cross-row arithmetic",
)
OPS.declare_invariant(["ep_dispatch"], "row copies and exchange")
OPS.declare_invariant(
    ["ep_combine"], "one program per token sums its k outputs in top-k slot order (no atomics)"
)
OPS.declare_invariant(
    ["mla_prefill"],
    "programs per (request, query block, head) with tiles fixed by the head widths and dtype, so batch "
    "mates share no arithmetic; NOT invariant to how a prompt is chunked (deterministic mode runs every "
    "token through mla_decode)",
)

__all__ = [
    "OPS",
    "activation",
    "cache",
    "ep",
    "grouped_gemm",
    "linear",
    "mla_decode",
    "mla_prefill",
    "moe",
    "norm",
    "quant_linear",
    "quant_moe",
    "rope",
    "routing",
    "sampling",
    "token_mask",
]
