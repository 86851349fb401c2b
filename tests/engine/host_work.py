"""Counting the host work of a stretch of code, deterministically (no clocks): Python bytecodes
executed, the peak of memory Python and numpy allocate, and the elements of the new tensors torch ops
produce (views and in-place writes excluded). Used by the host-work tests."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


class _NewTensorElements(TorchDispatchMode):
    """Counts the elements of every op output whose storage is not one of the op's inputs'."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled; skipping would import torch._dynamo (seconds)

    def __torch_dispatch__(self, func: Callable, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
        }
        self.count += sum(
            t.numel()
            for t in tree_leaves(out)
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in inputs
        )
        return out


class HostWork:
    """``with HostWork() as work:`` counts the block's work into ``opcodes``, ``host_bytes`` (peak of
    Python/numpy memory above the start) and ``torch_elements``; ``with work.paused():`` leaves a part
    of it uncounted (bytecodes and tensors; memory stays traced)."""

    def __init__(self) -> None:
        self.opcodes = 0
        self.host_bytes = 0
        self.torch_elements = 0
        self._elements = _NewTensorElements()
        self._base = 0
        self._started_tracemalloc = False

    def as_dict(self) -> dict[str, int]:
        return {"opcodes": self.opcodes, "host_bytes": self.host_bytes, "torch_elements": self.torch_elements}

    def _trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        return self._count

    def _count(self, frame, event, arg):
        self.opcodes += event == "opcode"
        return self._count

    def __enter__(self) -> HostWork:
        self._started_tracemalloc = not tracemalloc.is_tracing()
        if self._started_tracemalloc:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        self._elements.__enter__()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        self._elements.__exit__(*exc)
        self.host_bytes = tracemalloc.get_traced_memory()[1] - self._base
        self.torch_elements = self._elements.count
        if self._started_tracemalloc:
            tracemalloc.stop()

    @contextmanager
    def paused(self) -> Iterator[None]:
        sys.settrace(None)
        try:
            with _disable_current_modes():
                yield
        finally:
            sys.settrace(self._trace)
