"""Decode steps captured as device graphs (CUDA graphs, ACL graphs, CPU graphs), one per batch size.

A step where every request computes exactly one token runs the model forward by replaying a graph
captured for the next batch size up among the platform's ``graph_batch_sizes`` (1, 2, 4, ... on
devices; every size on the CPU, which pads nothing). Inputs are copied into static buffers first;
padding rows are requests of length one whose token is written to, and read from, a block reserved for
padding, so they never touch real requests' cache. Captured lazily, on the first step of each size,
through the platform's graph wrapper (the eager wrapper re-runs the forward, which keeps this code path
testable on any backend). A forward the wrapper refuses to capture (``GraphCaptureError``: it reads a
value on the host, for instance) turns graphs off for the engine, with a warning naming why: every size
runs the same forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from deepinfer.logger import get_logger
from deepinfer.model.attn_metadata import AttentionMetadata, DecodeMetadata
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.platform.interface import GraphCapture, GraphCaptureError

logger = get_logger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: Sequence[Sequence[Tensor]],
        new_graph: Callable[[], GraphCapture],
        sizes: Sequence[int],
        max_blocks_per_request: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
        session_factory: Callable[[], Any] | None = None,
    ) -> None:
        """``sizes``: the batch sizes graphs are captured for, ascending (the platform's
        ``graph_batch_sizes``); a step pads up to the next."""
        self.model = model
        self.kv_caches = kv_caches
        self.new_graph = new_graph
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be ascending, distinct and >= 1, got {list(sizes)}")
        self.sizes = list(sizes)
        max_batch = self.sizes[-1]
        self.block_size = block_size
        self.pad_block = pad_block
        pad_slot = pad_block * block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), pad_slot, dtype=torch.int64, device=device)
        self.block_table = torch.full(
            (max_batch, max_blocks_per_request), pad_block, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.session_factory = session_factory  # the op backend's, when captures bake host values
        self.graphs: dict[int, tuple[GraphCapture, Tensor, Any]] = {}
        self.refused: str | None = None  # why capture failed, after which every step runs eagerly

    def applicable(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """True for a decode-only step (one token per request) that fits the largest graph."""
        d = meta.decode
        return (
            self.refused is None
            and meta.prefill is None
            and d is not None
            and d.max_query_len == 1
            and num_tokens <= self.sizes[-1]
        )

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """The model's final hidden states [n, D] for a decode-only step, by graph replay; None when the
        forward cannot be captured (then graphs stay off and the caller runs it eagerly)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        if size not in self.graphs:
            try:
                self.graphs[size] = self._capture(size)
            except GraphCaptureError as exc:
                self.refused = str(exc)
                logger.warning(
                    "decode graphs off, every step runs eagerly: the forward cannot be captured: %s", exc
                )
                return None
        d = meta.decode
        width = min(d.block_table.shape[1], self.block_table.shape[1])  # wider columns are never read
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_table[:n, :width].copy_(d.block_table[:, :width])
        self.seq_lens[:n].copy_(d.seq_lens)
        if n < size:
            self._reset_padding(n, size)
        graph, hidden, session = self.graphs[size]
        if session is not None:
            session.update(self.seq_lens[:size].tolist(), self.query_start_loc[: size + 1].tolist())
        graph.replay()
        return hidden[:n]

    def _reset_padding(self, n: int, size: int) -> None:
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(self.pad_block * self.block_size)
        self.block_table[n:size].fill_(self.pad_block)
        self.seq_lens[n:size].fill_(1)

    def _capture(self, size: int) -> tuple[GraphCapture, Tensor, Any]:
        self._reset_padding(0, size)
        meta = AttentionMetadata(
            self.slot_mapping[:size],
            DecodeMetadata(
                num_tokens=size,
                block_table=self.block_table[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                max_query_len=1,
            ),
            None,
        )
        graph = self.new_graph()
        session = self.session_factory() if self.session_factory is not None else None
        with session.recording() if session is not None else contextlib.nullcontext():
            hidden = graph.capture(
                lambda: self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
            )
        return graph, hidden, session
