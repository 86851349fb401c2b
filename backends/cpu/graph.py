"""CPU graphs: a step's operator calls recorded once, then replayed from C++ without Python.

The CPU analogue of a CUDA graph, for the same purpose: at small batches a decode step is mostly the
host's work of dispatching a hundred-odd small ops from Python (module calls, the op interface,
argument parsing), not the ops themselves. ``CpuGraph.capture(fn)`` runs ``fn`` once, eagerly, under a
``TorchDispatchMode`` that records every operator call that reaches the dispatcher (after Python,
after autograd; ops called from inside a native kernel are that kernel's business and are not seen),
with the tensors each one reads and returns. The recording becomes an ``OpGraph`` (``csrc/graph.cpp``):
per call, the operator handle and its arguments, constants converted once, tensors as numbered slots.
``replay()`` runs the calls through the boxed dispatcher from C++, with the GIL released, and copies the
results into the tensors ``capture`` returned.

The contract is a CUDA graph's (``GraphCapture``): ``fn`` reads only tensors that stay alive and at a
fixed address (weights, the KV cache, static input buffers the caller refreshes in place before each
replay), its shapes and control flow do not depend on tensor values, and it draws no random numbers.
What a recording can see breaking that contract is refused at capture with ``GraphCaptureError`` naming
the op: a value read to the host (``.item()``, ``.tolist()``, a tensor in an ``if``), a tensor made from
host data inside ``fn`` (``torch.tensor``), a random op, an op returning a non-tensor. Unlike a CUDA
graph, intermediate tensors are allocated anew at each replay (and freed after their last reader), so
a graph holds no memory pool of its own and costs one eager run to capture.

Created by the ``cpu`` platform's ``graph()`` when the fast backend is active; used by
``deepinfer.worker.graphs.DecodeGraphs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepinfer.backends.cpu.native import module
from deepinfer.platform.interface import GraphCapture, GraphCaptureError

# Ops whose result depends on host reads or host data: a replay would repeat the recorded value.
_HOST_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::lift_fresh", "aten::lift_fresh_copy"}


class _Recorder(TorchDispatchMode):
    """Every dispatched op call of the captured function, in order: (op, args, kwargs, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch._ops.OpOverload, tuple, dict, Any]] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep TorchDynamo out of it, importing torch._dynamo
        # (and sympy) at its first call: seconds of start-up for nothing, as nothing here is compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_OPS:
            raise GraphCaptureError(
                f"{name} during graph capture: the captured function reads a tensor's value on the host or "
                "builds a tensor from host data, which a replay would repeat unchanged"
            )
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise GraphCaptureError(f"{name} during graph capture: a replay would repeat its random draw")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for leaf in tree_flatten(out)[0]:
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise GraphCaptureError(
                    f"{name} during graph capture returned {type(leaf).__name__}; a graph replays tensor ops only"
                )
        self.calls.append((func, args, kwargs, out))
        return out


class _Program:
    """Numbers the recorded tensors into slots and builds the native ``OpGraph``."""

    def __init__(self, calls: list[tuple[torch._ops.OpOverload, tuple, dict, Any]], outputs: Any) -> None:
        self.slot_of: dict[int, int] = {}  # id(tensor) -> its slot (the newest one, for in-place results)
        self.keep: list[torch.Tensor] = []  # every recorded tensor, alive so that ids stay unique
        self.bound: list[tuple[int, torch.Tensor]] = []
        nodes = []
        for func, args, kwargs, out in calls:
            schema = func._schema
            encoded = [self._encode(value) for value in _positional(schema, args, kwargs)]
            produced = [self._new_slot(t) if t is not None else -1 for t in tree_flatten(out)[0]]
            nodes.append((schema.name, schema.overload_name, encoded, produced))
        leaves = tree_flatten(outputs)[0]
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise GraphCaptureError(
                "a captured function must return tensors (a tensor, or a tuple/list of them)"
            )
        output_slots = [self.slot_of.get(id(t), -1) for t in leaves]
        if -1 in output_slots:
            raise GraphCaptureError("a captured function returned a tensor that no recorded op produced")

        last_read = {}
        for i, (_, _, encoded, _) in enumerate(nodes):
            for kind, value in encoded:
                for slot in (value,) if kind == "t" else value if kind == "l" else ():
                    if slot >= 0:
                        last_read[slot] = i
        released: list[list[int]] = [[] for _ in nodes]
        bound = {slot for slot, _ in self.bound}
        for slot, i in last_read.items():
            if slot not in bound and slot not in output_slots:
                released[i].append(slot)

        graph = module().OpGraph(len(self.keep))
        for slot, tensor in self.bound:
            graph.bind(slot, tensor)
        for (name, overload, encoded, produced), release in zip(nodes, released):
            graph.add_node(name, overload, encoded, produced, release)
        graph.set_outputs(output_slots, leaves)
        self.graph = graph
        self.keep.clear()  # the graph holds the bound tensors; intermediates are made at each replay
        self.slot_of.clear()

    def _new_slot(self, tensor: torch.Tensor) -> int:
        slot = len(self.keep)
        self.keep.append(tensor)
        self.slot_of[id(tensor)] = slot
        return slot

    def _slot(self, tensor: torch.Tensor) -> int:
        slot = self.slot_of.get(id(tensor))
        if slot is None:  # made before the capture: bound to the graph for good
            slot = self._new_slot(tensor)
            self.bound.append((slot, tensor))
        return slot

    def _encode(self, value: Any) -> tuple[str, Any]:
        if isinstance(value, torch.Tensor):
            return ("t", self._slot(value))
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return ("l", [-1 if v is None else self._slot(v) for v in value])
        return ("c", value)


def _positional(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> list[Any]:
    """Every schema argument in order: given positionally, by keyword, or its default."""
    values = []
    for i, argument in enumerate(schema.arguments):
        if i < len(args):
            values.append(args[i])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise GraphCaptureError(f"{schema.name}: argument {argument.name!r} was not given")
    return values


class CpuGraph(GraphCapture):
    """Capture once, then replay the recorded ops natively (see the module docstring)."""

    def __init__(self) -> None:
        self._graph: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        recorder = _Recorder()
        with recorder:
            outputs = fn()
        self._graph = _Program(recorder.calls, outputs).graph
        return outputs

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("replay() called before capture()")
        self._graph.replay()

    def replay_timed(self) -> list[tuple[str, float]]:
        """A replay that also returns, per recorded op call in order, its name and wall seconds."""
        if self._graph is None:
            raise RuntimeError("replay_timed() called before capture()")
        seconds = self._graph.replay_timed()
        return [(self._graph.node_name(i), s) for i, s in enumerate(seconds)]

    @property
    def num_ops(self) -> int:
        """Operator calls one replay makes."""
        return 0 if self._graph is None else self._graph.num_nodes
