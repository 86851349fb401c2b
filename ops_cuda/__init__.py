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
    mla_decode,
    mla_prefill,
    moe,
    norm,
    rope,
    routing,
    sampling,
    token_mask,
)

__all__ = [
    "OPS",
    "activation",
    "cache",
    "ep",
    "grouped_gemm",
    "mla_decode",
    "mla_prefill",
    "moe",
    "norm",
    "rope",
    "routing",
    "sampling",
    "token_mask",
]
