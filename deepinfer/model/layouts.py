"""Checkpoint tensor layouts: transformers 5 keeps routed experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]); DeepSeek publishes them
per expert (``mlp.experts.{e}.gate_proj.weight`` ...), which is what most tools read."""

from __future__ import annotations

import torch


def to_published_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split every fused expert tensor into DeepSeek's per-expert tensors; others pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out
