"""The reference backend: every interface op in plain PyTorch.

It is both the CPU backend (``DEEPINFER_ACCELERATOR=cpu``) and the numerical oracle of the conformance
suite. Written for clarity first, then for reasonable CPU speed: loops run over requests or experts,
never over tokens. Being plain PyTorch, it also runs on any torch device.
"""

from deepinfer.backends.registry import REFERENCE_BACKEND, OpTable

OPS = OpTable(REFERENCE_BACKEND)

from deepinfer.backends.reference import (  # noqa: E402  (submodules register into OPS)
    attention,
    cache,
    deterministic,
    ep,
    linear,
    moe,
    norm,
    quant,
    rope,
    sampling,
)

__all__ = [
    "OPS",
    "attention",
    "cache",
    "deterministic",
    "ep",
    "linear",
    "moe",
    "norm",
    "quant",
    "rope",
    "sampling",
]
