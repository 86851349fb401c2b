"""Emulated ``torch.npu`` runtime: streams, events, and ACL graphs with task groups and task updates.

A captured graph is a task list: every aten op issued while capturing, and every emulated torch_npu op
as one task (the aten ops inside it are its "kernel"). ``replay()`` re-runs the tasks on the same tensor
objects and copies fresh results into the captured outputs, so a graph sees new input values but its
host arguments (Python ints and lists) stay as captured, as on the device. ``graph_task_group_begin/end``
delimit the tasks of one call and return its handle; between ``graph_task_update_begin(stream, handle)``
and ``graph_task_update_end(stream)`` a torch_npu call does not run but replaces that group's task,
arguments and all (what the device does with the new tiling). Host synchronisation (``.item()``) during
capture raises, as it does on the device. Streams and events order nothing here (execution is
synchronous) but their API is checked.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


@dataclass(slots=True)
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]

    def run(self) -> None:
        fresh, _ = tree_flatten(self.fn(*self.args, **self.kwargs))
        for old, new in zip(self.outputs, (t for t in fresh if isinstance(t, torch.Tensor))):
            if new.data_ptr() != old.data_ptr():
                old.copy_(new)


class _State:
    device: str = "Ascend910B3"  # what get_device_name reports; set_device_name changes it
    capturing: NPUGraph | None = None
    updating: tuple[NPUGraph, int, int] | None = None
    inside_op = False
    group_start: int | None = None


_state = _State()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        graph = _state.capturing
        if graph is None or _state.inside_op:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing (host synchronisation)")
        result = func(*args, **kwargs)
        if func not in _NO_KERNEL:
            graph.tasks.append(_Task(func, args, kwargs, _tensors(result)))
        return result


class NPUGraph:
    def __init__(self) -> None:
        self.tasks: list[_Task] = []
        self._mode: _Recorder | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if _state.capturing is not None:
            raise RuntimeError("a graph is already being captured")
        _state.capturing = self
        self._mode = _Recorder()
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)
        _state.capturing = None

    def replay(self) -> None:
        for task in self.tasks:
            task.run()

    def reset(self) -> None:
        self.tasks.clear()


@contextlib.contextmanager
def graph(
    npu_graph: NPUGraph, pool: Any = None, stream: Any = None, capture_error_mode: str = "global"
) -> Iterator[None]:
    npu_graph.capture_begin(pool, capture_error_mode)
    try:
        yield
    finally:
        npu_graph.capture_end()


def npu_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make an emulated torch_npu op a single graph task (or a task replacement during an update)."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        if _state.inside_op:
            return fn(*args, **kwargs)
        if _state.updating is not None:
            target, start, end = _state.updating
            if end - start != 1:
                raise RuntimeError(
                    f"a task group being updated must hold one op, this one holds {end - start}"
                )
            target.tasks[start] = _Task(fn, args, kwargs, target.tasks[start].outputs)
            return None
        _state.inside_op = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _state.inside_op = False
        if _state.capturing is not None:
            _state.capturing.tasks.append(_Task(fn, args, kwargs, _tensors(result)))
        return result

    return op


def host_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A torch_npu function that launches no kernel (it sizes or allocates): never a graph task."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        previous, _state.inside_op = _state.inside_op, True
        try:
            return fn(*args, **kwargs)
        finally:
            _state.inside_op = previous

    return call


def get_device_name(device: Any = None) -> str:
    """The emulated NPU's name (``torch.npu.get_device_name``): an A2 (Ascend910B3) unless changed."""
    return _state.device


def device_name() -> str:
    return _state.device


def set_device_name(name: str) -> None:
    """Emulation only: which chip the emulated ops behave as (e.g. "Ascend950PR", "Ascend910_9382")."""
    _state.device = name


def is_current_stream_capturing() -> bool:
    return _state.capturing is not None


def graph_task_group_begin(stream: Stream) -> None:
    if _state.capturing is None:
        raise RuntimeError("graph_task_group_begin outside graph capture")
    _state.group_start = len(_state.capturing.tasks)


def graph_task_group_end(stream: Stream) -> tuple[NPUGraph, int, int]:
    if _state.capturing is None or _state.group_start is None:
        raise RuntimeError("graph_task_group_end without graph_task_group_begin")
    handle = (_state.capturing, _state.group_start, len(_state.capturing.tasks))
    _state.group_start = None
    return handle


def graph_task_update_begin(stream: Stream, handle: tuple[NPUGraph, int, int]) -> None:
    if _state.capturing is not None:
        raise RuntimeError("graph_task_update_begin while capturing")
    _state.updating = handle


def graph_task_update_end(stream: Stream) -> None:
    if _state.updating is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin")
    _state.updating = None


class Stream:
    def wait_stream(self, other: Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_default_stream = Stream()
_current: list[Stream] = [_default_stream]


def current_stream() -> Stream:
    return _current[-1]


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[None]:
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


def synchronize() -> None:
    pass


class ExternalEvent:
    """Records which stream last recorded it (the update stream, after a task update)."""

    def __init__(self) -> None:
        self.recorded_on: Stream | None = None

    def wait(self, s: Stream) -> None:
        pass

    def reset(self, s: Stream) -> None:
        self.recorded_on = None

    def record(self, s: Stream) -> None:
        self.recorded_on = s
