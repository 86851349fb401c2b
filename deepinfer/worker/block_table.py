"""The input builder's persistent block table: one host row of block ids per scheduled request, kept
across steps and updated by differences, so a decode step writes only the blocks it newly got.

Owned by ``InputBuilder`` (host memory, int32). A row is tied to the block-id list the scheduler
passes (``ScheduledRequest.block_ids``, the KV manager's own list, which only grows while the request
holds its blocks): while the same list comes back, only its new tail is copied in; a different list
(the request was freed and re-allocated, or a caller passed a copy) rewrites the row. Rows of
requests absent from a step stay until a new request needs a row and none is free (so the drafter's
passes over a subset of the batch, or a request skipped for one step, cost nothing).

The decode attention's block table (``step_table``, on the model's device) is kept the same way: a
few recent step tables, each a copy of some rows in a step's order, are reused while the same rows
come back in the same order, with only the row writes made since applied to them. A step table is
rebuilt (a copy of its rows) only when the batch's rows change or its longest request outgrows its
width, which is rounded up to a power of two so that this happens a logarithmic number of times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

STEP_TABLES = 4  # step tables kept (the runner's batch and the drafter's passes over parts of it)


def _power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(slots=True)
class _Row:
    index: int
    source: list[int]  # the block-id list the row mirrors
    written: int  # entries of ``source`` copied into the row


@dataclass(slots=True)
class _StepTable:
    rows: np.ndarray  # [B] int64 persistent rows, in the step's order
    position: dict[int, int]  # persistent row -> its index in ``rows``
    tensor: Tensor  # [B, width] int32 on the device
    synced: int  # row writes (``BlockTable._log`` positions, absolute) already applied


class BlockTable:
    def __init__(self, rows: int = 8, width: int = 16) -> None:
        self.tensor = torch.zeros(rows, width, dtype=torch.int32)  # [rows, width] host, grown by doubling
        self.array = self.tensor.numpy()  # the same memory, for host-side slot arithmetic
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._log: list[tuple[int, int, int]] = []  # (row, start, end) of each row write
        self._log_start = 0  # absolute position of ``_log[0]``
        self._step_tables: list[_StepTable] = []  # most recently used last
        self.entries_written = 0  # block ids copied into rows so far (a host-work counter)
        self.entries_copied = 0  # block ids copied into step tables so far (a host-work counter)

    def update(self, request_ids: Sequence[str], block_ids: Sequence[list[int]]) -> np.ndarray:
        """Bring the rows of this step's requests up to date; returns their row indices [B] int64,
        in the given order."""
        needed = max(len(ids) for ids in block_ids)
        if needed > self.tensor.shape[1]:
            self._grow(self.tensor.shape[0], max(_power_of_two(needed), 2 * self.tensor.shape[1]))
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
                self._log.append((row.index, row.written, len(ids)))
                self.entries_written += len(ids) - row.written
                row.written = len(ids)
            rows[i] = row.index
        self._trim_log()  # with no step table kept (steps without decode requests) the log stays empty
        return rows

    def step_table(self, rows: np.ndarray, width: int, device: torch.device) -> Tensor:
        """The block table [len(rows), W] int32 on ``device`` of rows ``rows`` (from ``update``), in
        that order, with ``W >= width``; columns past a row's blocks hold stale but valid block ids.
        The tensor is reused and updated in place by later calls with the same rows."""
        for i, table in enumerate(self._step_tables):
            if table.tensor.shape[1] >= width and np.array_equal(table.rows, rows):
                self._step_tables.append(self._step_tables.pop(i))
                self._sync(table)
                return table.tensor
        cols = min(self.tensor.shape[1], _power_of_two(width))
        rows = rows.copy()
        tensor = self.tensor[torch.from_numpy(rows), :cols].to(device)
        self.entries_copied += tensor.numel()
        position = {int(r): i for i, r in enumerate(rows)}
        self._step_tables.append(_StepTable(rows, position, tensor, self._log_start + len(self._log)))
        del self._step_tables[:-STEP_TABLES]
        self._trim_log()
        return tensor

    def _sync(self, table: _StepTable) -> None:
        """Apply the row writes made since ``table`` was last used to it."""
        cols = table.tensor.shape[1]
        flat: list[np.ndarray] = []
        for row, start, end in self._log[table.synced - self._log_start :]:
            i = table.position.get(row)
            end = min(end, cols)
            if i is not None and start < end:
                flat.append(np.arange(i * cols + start, i * cols + end))
        table.synced = self._log_start + len(self._log)
        if flat:
            index = np.concatenate(flat)
            values = self.array[table.rows[index // cols], index % cols]
            table.tensor.view(-1)[torch.from_numpy(index).to(table.tensor.device)] = torch.from_numpy(
                values
            ).to(table.tensor.device)
            self.entries_copied += index.size
        self._trim_log()

    def _trim_log(self) -> None:
        """Forget row writes every kept step table has applied; a step table with more pending writes
        than entries is dropped instead (rebuilding it costs less than catching up)."""
        end = self._log_start + len(self._log)
        self._step_tables = [t for t in self._step_tables if end - t.synced <= t.tensor.numel()]
        keep_from = min((t.synced for t in self._step_tables), default=end)
        del self._log[: keep_from - self._log_start]
        self._log_start = keep_from

    def _release_absent(self, present: set[str]) -> None:
        for rid in [rid for rid in self._rows if rid not in present]:
            self._free.append(self._rows.pop(rid).index)

    def _grow(self, rows: int, width: int) -> None:
        old = self.tensor
        self.tensor = torch.zeros(rows, width, dtype=torch.int32)
        self.tensor[: old.shape[0], : old.shape[1]] = old
        self.array = self.tensor.numpy()
        self._free += list(range(rows - 1, old.shape[0] - 1, -1))
