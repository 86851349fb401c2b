"""The Platform interface: what the engine needs to know about the machine it runs on.

A Platform is created by ``deepinfer.platform.registry.resolve_platform`` from a successful
``detect()``; the engine holds one per process and asks it for devices, the collective backend, memory,
graph capture and the name of the op backend to activate. Nothing vendor-specific is imported until a
platform class is detected or instantiated; subclasses import their vendor modules inside methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from deepinfer.platform.chips import ChipFacts, NodeRole, chip_facts


class PlatformUnavailableError(RuntimeError):
    """An explicitly requested platform cannot run on this host; the message names what is missing."""


@dataclass(frozen=True, slots=True)
class Detection:
    """Result of probing the host for one platform.

    ``reason`` always says why: what was found when available, what is missing when not.
    ``chip`` is a key of ``deepinfer.platform.chips.CHIPS``.
    """

    available: bool
    reason: str
    device_name: str = ""
    chip: str = ""


class GraphCaptureError(RuntimeError):
    """A captured function does something its replay could not reproduce (the message names what)."""


class GraphCapture(ABC):
    """Captures a step function once and replays it on the same (static) input and output tensors.

    ``capture(fn)`` runs ``fn`` (which reads only tensors that stay alive and fixed in address) and
    returns its outputs; after the caller refreshes the inputs in place, ``replay()`` recomputes those
    same output tensors in place. Platforms without graphs implement this by re-running ``fn`` eagerly
    and copying into the captured outputs, so the engine code is identical everywhere. ``capture`` may
    raise ``GraphCaptureError`` when ``fn`` breaks the contract in a way the wrapper can see.
    """

    @abstractmethod
    def capture(self, fn: Callable[[], Any]) -> Any: ...

    @abstractmethod
    def replay(self) -> None: ...


class EagerGraph(GraphCapture):
    """The no-graph capture: replay re-runs the function and copies results into the first outputs."""

    def __init__(self) -> None:
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self._fn = fn
        self._outputs = fn()
        return self._outputs

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay() called before capture()")
        _copy_into(self._outputs, self._fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        if len(dst) != len(src):
            raise RuntimeError("graph outputs changed structure between capture and replay")
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif isinstance(dst, dict):
        for k, d in dst.items():
            _copy_into(d, src[k])
    elif dst != src:
        raise RuntimeError(f"non-tensor graph output changed between capture and replay: {dst!r} -> {src!r}")


class Platform(ABC):
    """One kind of machine: CPU host, NVIDIA GPU, Ascend NPU, or an out-of-tree device.

    Class attributes describe the kind; instance attributes describe what ``detect()`` found.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    dist_backend: ClassVar[str]
    visible_devices_env: ClassVar[str | None]
    op_backend: ClassVar[str]
    """Module whose import builds this platform's op table (``OPS``), e.g. ``deepinfer.ops_cuda``."""

    def __init__(self, detection: Detection) -> None:
        if not detection.available:
            raise PlatformUnavailableError(detection.reason)
        self.detection = detection
        self.device_name = detection.device_name
        self.chip: ChipFacts = chip_facts(detection.chip)

    @classmethod
    @abstractmethod
    def detect(cls) -> Detection:
        """Probe the host. Must not raise for a missing device or library: report it in ``reason``."""

    @property
    def node_role(self) -> NodeRole:
        """prefill, decode or both (Ascend 950PR -> prefill, 950DT -> decode, others -> both)."""
        return self.chip.role

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def synchronize(self) -> None:  # noqa: B027  (a no-op is the right default for synchronous devices)
        """Wait for all queued device work; a no-op where execution is synchronous."""

    @abstractmethod
    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory that holds weights and the KV cache."""

    def graph(self, pool: Any = None) -> GraphCapture:
        """A fresh graph-capture wrapper; the default runs eagerly. ``pool``: a handle from
        ``graph_pool()`` that every graph of one engine shares (None: the graph's own memory)."""
        return EagerGraph()

    def graph_pool(self) -> Any:
        """A memory pool handle for ``graph(pool)``: graphs captured into one pool reuse each other's
        intermediate memory, so an engine's decode graphs together hold about what its largest one needs
        (they never replay concurrently, and each one's outputs are read before the next replays). None
        where graphs hold no memory of their own (the default, and the CPU)."""
        return None

    @abstractmethod
    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        """Bytes of the memory ``mem_get_info`` reports that running ``fn()`` needed at its peak beyond
        what was in use when it began (its temporaries, and whatever it keeps). The engine sizes the KV
        cache with it: the peak of one step at the token budget is left free."""

    @property
    def graph_capture_default(self) -> bool:
        """Whether decode steps replay captured graphs when ``EngineConfig.graph_capture`` is left
        unset. Off by default; a platform turns it on where its graphs are proven here."""
        return False

    def graph_batch_sizes(self, max_batch: int) -> list[int]:
        """Batch sizes to capture decode graphs for (a step pads up to the next one), ascending and
        ending at ``max_batch``. The default, powers of two, suits devices where a padded row costs
        little next to a graph's memory; a platform whose graphs hold no memory of their own may
        capture every size and pad nothing."""
        sizes, size = [], 1
        while size < max_batch:
            sizes.append(size)
            size *= 2
        return [*sizes, max_batch]

    def lm_head_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's weight [V, D] laid out as this platform's GEMMs read it fastest at decode
        (a few rows against a wide vocabulary): the same shape and values, possibly other strides.
        The default keeps it as loaded."""
        return weight

    def describe(self) -> str:
        return f"{self.name} ({self.device_name}; chip {self.chip.key}, role {self.node_role.value})"


def device_peak_memory_of(device_module: Any, fn: Callable[[], Any]) -> int:
    """``Platform.peak_memory_of`` over a caching allocator whose device module mirrors ``torch.cuda``
    (``torch.cuda``, ``torch.npu``): the allocator's peak of allocated bytes during ``fn`` above what was
    allocated when it began."""
    m = device_module
    m.synchronize()
    m.reset_peak_memory_stats()
    base = m.memory_allocated()
    fn()
    m.synchronize()
    return max(0, m.max_memory_allocated() - base)


class DeviceGraph(GraphCapture):
    """Graph capture over a torch device module that mirrors ``torch.cuda`` (``torch.cuda``,
    ``torch.npu``): one warm-up run on a side stream, then capture into ``graph_cls()``, in the memory
    pool ``pool`` (a ``graph_pool_handle()`` shared by an engine's graphs; None: a private pool)."""

    def __init__(self, device_module: Any, graph_cls: Callable[[], Any], pool: Any = None) -> None:
        self._m = device_module
        self._graph_cls = graph_cls
        self._pool = pool
        self._graph: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        m = self._m
        side = m.Stream()
        side.wait_stream(m.current_stream())
        with m.stream(side):
            fn()
        m.current_stream().wait_stream(side)
        self._graph = self._graph_cls()
        with m.graph(self._graph, pool=self._pool):
            outputs = fn()
        return outputs

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("replay() called before capture()")
        self._graph.replay()
