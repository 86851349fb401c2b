"""Seeded sampling: the Ascend C kernel when it is built and passed its self-test, else torch on the NPU.

Both paths implement the interface exactly: filters on the temperature-scaled distribution (top-k by
rank with ties broken by lower token id, top-p on the top-k renormalised distribution, min-p), then the
Gumbel-max draw ``argmax(log p + g)`` with ``g = -log(-log(u))`` and ``u = counter_uniform(seed, offset,
token)``, so a request draws the same tokens here as on every other backend.

The fallback runs the reference implementation's torch code on the NPU (a stable sort for the filters,
integer ops for the counter noise); it is declared through the op registry on first use, with the
reason (a WARNING, listed in ``OpTable.describe()`` and ``reference_fallbacks``). ``npu_top_k_top_p`` is deliberately not used: per its doc it keeps
every token equal to the k-th largest value (the interface keeps exactly k, lower ids first), accumulates
top-p from the least probable token up, and takes k only in [1, 1024] (so "top-k off" is not expressible
for a 129k vocabulary); with bfloat16 logits such ties are common, and the token-for-token conformance
check would fail. ``npu_top_k_top_p_sample`` is excluded likewise (its doc: no graph mode, qSample noise).
"""

from __future__ import annotations

from torch import Tensor

from deepinfer.backends.reference import sampling as reference
from deepinfer.ops_ascend import OPS
from deepinfer.ops_ascend.native import sampling_kernel


@OPS.implement
def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
) -> Tensor:
    kernel, why = sampling_kernel(logits.device)
    if kernel is None:
        OPS.fallback_at_runtime("sample", why)
        return reference.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return kernel(logits, temperature, top_k, top_p, min_p, seeds, offsets)
