"""Checkpoint tensor layouts: transformers 5 keeps routed experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]); DeepSeek publishes them
per expert (``mlp.experts.{e}.gate_proj.weight`` ...), which is what most tools read."""

from __future__ import annotations

import re

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


_PER_EXPERT = re.compile(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_name(name: str) -> str:
    """The fused-layout name a per-expert tensor name belongs to (other names unchanged)."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return name
    return m.group(1) + ("down_proj" if m.group(3) == "down_proj" else "gate_up_proj")


def to_fused_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse: stack per-expert tensors into transformers 5's fused ones."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, by_index in experts.items():
        order = [by_index[e] for e in sorted(by_index)]
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat((p["gate_proj"], p["up_proj"])) for p in order])
        out[prefix + "down_proj"] = torch.stack([p["down_proj"] for p in order])
    return out
