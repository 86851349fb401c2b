"""The input builder's persistent block table: one host row of block ids per scheduled request, kept
across steps and updated by differences, so a decode step writes only the blocks it newly got.

Owned by ``InputBuilder`` (host memory, int32). A row is tied to the block-id list the scheduler
passes (``ScheduledRequest.block_ids``, the KV manager's own list, which only grows while the request
holds its blocks): while the same list comes back, only its new tail is copied in; a different list
(the request was freed and re-allocated, or a caller passed a copy) rewrites the row. Rows of
requests absent from a step stay until a new request needs a row and none is free (so the drafter's
passes over a subset of the batch, or a request skipped for one step, cost nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class _Row:
    index: int
    source: list[int]  # the block-id list the row mirrors
    written: int  # entries of ``source`` copied into the row


class BlockTable:
    def __init__(self, rows: int = 8, width: int = 16) -> None:
        self.tensor = torch.zeros(rows, width, dtype=torch.int32)  # [rows, width] host, grown by doubling
        self.array = self.tensor.numpy()  # the same memory, for host-side slot arithmetic
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self.entries_written = 0  # block ids copied into rows so far (a host-work counter)

    def update(self, request_ids: Sequence[str], block_ids: Sequence[list[int]]) -> np.ndarray:
        """Bring the rows of this step's requests up to date; returns their row indices [B] int64,
        in the given order."""
        needed = max(len(ids) for ids in block_ids)
        if needed > self.tensor.shape[1]:
            self._grow(self.tensor.shape[0], max(needed, 2 * self.tensor.shape[1]))
        rows = np.empty(len(request_ids), dtype=np.int64)
        for i, (rid, ids) in enumerate(zip(request_ids, block_ids)):
            row = self._rows.get(rid)
            if row is None or row.source is not ids or len(ids) < row.written:
                if row is None:
                    if not self._free:
                        self._release_absent(set(request_ids))
                    if not self._free:
                        self._grow(2 * self.tensor.shape[0], self.tensor.shape[1])
                    row = self._rows[rid] = _Row(self._free.pop(), ids, 0)
                row.source, row.written = ids, 0
            if len(ids) > row.written:
                self.array[row.index, row.written : len(ids)] = ids[row.written :]
                self.entries_written += len(ids) - row.written
                row.written = len(ids)
            rows[i] = row.index
        return rows

    def gather(self, rows: np.ndarray, width: int) -> Tensor:
        """The step's block table [len(rows), width] int32 (a new host tensor)."""
        return self.tensor[torch.from_numpy(rows), :width]

    def _release_absent(self, present: set[str]) -> None:
        for rid in [rid for rid in self._rows if rid not in present]:
            self._free.append(self._rows.pop(rid).index)

    def _grow(self, rows: int, width: int) -> None:
        old = self.tensor
        self.tensor = torch.zeros(rows, width, dtype=torch.int32)
        self.tensor[: old.shape[0], : old.shape[1]] = old
        self.array = self.tensor.numpy()
        self._free += list(range(rows - 1, old.shape[0] - 1, -1))
