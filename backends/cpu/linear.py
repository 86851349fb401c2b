"""Dense projections for the CPU: the native ``linear`` (``csrc/linear.cpp``), and oneDNN for large
float32 products.

Up to eight rows (decode batches, the sampled rows' LM head) run skinny products that read the weight
in place in the layout it has: nn.Linear's [N, K] rows, or a transposed view with unit stride along N
(the D-major LM head, MLA's absorbed W_UK); at one row MKL's sgemm spends several times the product in
choosing its path. More rows go to MKL: ``at::linear``, and for the per-head form (x [T, H, K], weight
[H, N, K], the absorbed W_UK / W_UV) one ``at::bmm`` on transposed views, whose result is a [T, H, N]
view of the [H, T, N] product. The reference's ``einsum`` plans the contraction on every call.

A float32 2-D product of more than eight rows and at least ``ONEDNN_MIN_MACS`` multiply-adds goes to
oneDNN's inner product (``mkldnn::_linear_pointwise``, in every x86 and aarch64 torch build): its JIT
kernels pick their instruction set from the CPU's features, where MKL's sgemm, on AMD CPUs, takes a
slower path. On the AMD EPYC (AVX-512) these figures come from, oneDNN ran the bundled model's LM head
at 64 rows 1.7-2.3x faster than MKL and its prefill projections (8192 rows) 1.15-1.8x faster, but lost
below about eight million multiply-adds (a fixed cost near 20 us); on the Intel hosts we measured, it is
about even. Both compute each output as one float32 sum over K; results matched MKL's bit for bit for
K < 512 and within 1e-6 relative above.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()

SKINNY_ROWS = 8  # rows the native skinny products take (kSkinnyMax in csrc/linear.cpp)
ONEDNN_MIN_MACS = 1 << 23  # multiply-adds from which a float32 product goes to oneDNN
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@OPS.implement
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if (
        _ONEDNN
        and x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.shape[0] > SKINNY_ROWS
        and x.shape[0] * weight.shape[0] * weight.shape[1] >= ONEDNN_MIN_MACS
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return _native.linear(x, weight, bias)
