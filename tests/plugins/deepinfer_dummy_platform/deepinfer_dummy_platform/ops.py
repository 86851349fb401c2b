"""The dummy backend: its own silu_and_mul, the reference for everything else (declared)."""

import torch

from deepinfer.backends.registry import OpTable, interface_ops

OPS = OpTable("deepinfer_dummy_platform.ops")
CALLS = []


@OPS.implement
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(tuple(x.shape))
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


OPS.use_reference_for(sorted(set(interface_ops()) - {"silu_and_mul"}), reason="dummy backend")
