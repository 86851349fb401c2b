"""Greedy decoding for the CPU: each row's argmax by the native ``greedy`` (``csrc/sampling.cpp``), a
vector scan where torch's argmax compares one element at a time."""

from __future__ import annotations

from torch import Tensor

from deepinfer.backends.cpu.backend import OPS
from deepinfer.backends.cpu.native import load

_native = load()


@OPS.implement
def greedy(logits: Tensor) -> Tensor:
    return _native.greedy(logits)


OPS.declare_invariant(["greedy"], "native kernel: per row, an index comparison, no arithmetic")
