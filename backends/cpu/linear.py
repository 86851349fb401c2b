"""Dense projections for the CPU: the native ``linear`` (``csrc/linear.cpp``).

Up to eight rows (decode batches, the sampled rows' LM head) run skinny products that read the weight
in place in the layout it has: nn.Linear's [N, K] rows, or a transposed view with unit stride along N
(the D-major LM head, MLA's absorbed W_UK); at one row MKL's sgemm spends several times the product in
choosing its path. More rows go to MKL: ``at::linear``, and for the per-head form (x [T, H, K], weight
[H, N, K], the absorbed W_UK / W_UV) one ``at::bmm`` on transposed views, whose result is a [T, H, N]
view of the [H, T, N] product. The reference's ``einsum`` plans the contraction on every call.
"""

from __future__ import annotations

from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()


@OPS.implement
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _native.linear(x, weight, bias)
