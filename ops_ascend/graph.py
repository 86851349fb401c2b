"""Graph capture of decode attention: updating the host-side sequence lengths of captured FIA calls.

``npu_fused_infer_attention_score_v2`` takes ``actual_seq_qlen`` / ``actual_seq_kvlen`` as host lists,
which an ACL graph bakes into the captured task. torch_npu's graph task API lets them change between
replays (the mechanism vllm-ascend's ``update_graph_params`` uses; torch_npu 2.13 also automates it with
``torch.npu.graph(..., auto_dispatch_capture=True)``, which the platform's plain ``torch.npu.graph``
capture does not enable):

- capture: each decode attention call runs inside ``graph_task_group_begin/end(stream)`` as the ``.out``
  overload, with an output and a workspace sized by ``_npu_fused_infer_attention_score_v2_get_max_workspace``
  allocated before the group, after waiting on (and resetting) an ``ExternalEvent``;
- update, before each replay: on a side stream, ``graph_task_update_begin(stream, handle)``, the same call
  with the new lengths, ``graph_task_update_end(stream)``, then ``event.record(stream)`` so the replayed
  graph waits for the update.

Usage by a model runner (one updater per captured graph)::

    updater = AttentionLengthUpdater()
    with updater.recording():
        outputs = graph.capture(step)          # the platform's DeviceGraph; mla_decode calls are recorded
    ...
    # every step: refresh the static input tensors in place, then
    updater.update(seq_lens=[...], query_start_loc=[...])   # host lists, as mla_decode's arguments
    graph.replay()

The lists cover the captured batch: pad a smaller batch with dummy requests of one query token and a
length of at least 1 whose block-table row and slots point at a block the engine reserves for padding
(the kernel takes 1..16 query tokens per request, and the captured ``npu_scatter_pa_kv_cache`` takes slots
in [0, num_blocks * block_size) only: the eager filter of negative slots is not part of the graph).
Query counts may change between replays within 1..16, but a graph captured with one query token per
request (sparse mode 0, no mask) only replays such batches and one captured with several only replays
batches with several (sparse mode 3); ``update`` raises otherwise. Attention captured outside
``recording()`` raises instead of replaying stale lengths.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deepinfer.ops_ascend.npu import torch_npu

LengthsFn = Callable[[Sequence[int], Sequence[int]], dict[str, list[int]]]
"""(seq_lens, query_start_loc) host lists -> the host-list keyword arguments of one FIA call."""


@dataclass(slots=True)
class _CapturedCall:
    op: Any
    args: tuple[Tensor, ...]
    kwargs: dict[str, Any]
    lengths: LengthsFn
    handle: Any
    event: Any


_recording: AttentionLengthUpdater | None = None


class AttentionLengthUpdater:
    """Records the FIA calls captured inside ``recording()`` and re-issues them with new lengths."""

    def __init__(self) -> None:
        self._calls: list[_CapturedCall] = []
        self._stream: Any = None

    @property
    def num_calls(self) -> int:
        """How many attention calls (one per MLA layer and step function) were captured."""
        return len(self._calls)

    @contextlib.contextmanager
    def recording(self) -> Iterator[AttentionLengthUpdater]:
        """Within this block, attention calls made while a graph is being captured are recorded here."""
        global _recording
        if _recording is not None:
            raise RuntimeError("another AttentionLengthUpdater is already recording")
        _recording = self
        try:
            yield self
        finally:
            _recording = None

    def update(self, seq_lens: Sequence[int], query_start_loc: Sequence[int]) -> None:
        """Give every captured attention call these lengths; call before ``replay()``."""
        multi_query = max(b - a for a, b in itertools.pairwise(query_start_loc)) > 1
        for call in self._calls:
            if multi_query != (call.kwargs.get("sparse_mode", 0) == 3):
                captured = "several query tokens" if not multi_query else "one query token"
                raise ValueError(
                    f"this graph was captured with {captured} per request; capture another graph for this batch"
                )
        npu = torch.npu
        if self._stream is None:
            self._stream = npu.Stream()
        stream = self._stream
        with npu.stream(stream):
            for call in self._calls:
                npu.graph_task_update_begin(stream, call.handle)
                call.op(*call.args, **call.kwargs, **call.lengths(seq_lens, query_start_loc))
                npu.graph_task_update_end(stream)
                call.event.record(stream)

    def _capture(
        self,
        op_name: str,
        args: tuple[Tensor, ...],
        kwargs: dict[str, Any],
        lengths: LengthsFn,
        host: dict[str, list[int]],
    ) -> Tensor:
        npu_module, npu = torch_npu(), torch.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        workspace = getattr(npu_module, f"_{op_name}_get_max_workspace")(*args, **kwargs, **host)
        query, _, value = args
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        lse = torch.empty(1, dtype=torch.float32, device=query.device)
        static = {**kwargs, "workspace": workspace, "out": [out, lse]}
        op = getattr(npu_module, op_name).out
        npu.graph_task_group_begin(stream)
        op(*args, **static, **host)
        handle = npu.graph_task_group_end(stream)
        self._calls.append(_CapturedCall(op, args, static, lengths, handle, event))
        return out


def fused_infer_attention(
    op_name: str,
    args: tuple[Tensor, Tensor, Tensor],
    kwargs: dict[str, Any],
    lengths: LengthsFn,
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
) -> Tensor:
    """Run ``torch_npu.<op_name>(*args, **kwargs, **lengths(seq_lens, query_start_loc))`` and return its
    attention output: eagerly, or, while a graph is captured inside ``recording()``, as an updatable task.
    """
    npu_module = torch_npu()  # also makes torch.npu available
    host = lengths(seq_lens, query_start_loc)
    if not torch.npu.is_current_stream_capturing():
        return getattr(npu_module, op_name)(*args, **kwargs, **host)[0]
    if _recording is None:
        raise RuntimeError(
            f"{op_name} is being captured in an NPU graph outside AttentionLengthUpdater.recording(): its "
            "host sequence lengths would be frozen at their capture values (see deepinfer.ops_ascend.graph)"
        )
    return _recording._capture(op_name, args, kwargs, lengths, host)
