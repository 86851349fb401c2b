"""The persistent block table and its step tables: always what a full rebuild would give, at the cost
of the differences only."""

from __future__ import annotations

import random

import numpy as np
import torch

from deepinfer.worker.block_table import STEP_TABLES, BlockTable

CPU = torch.device("cpu")


def _check(table: BlockTable, ids: list[str], blocks: dict[str, list[int]]) -> torch.Tensor:
    rows = table.update(ids, [blocks[r] for r in ids])
    width = max(len(blocks[r]) for r in ids)
    step = table.step_table(rows, width, CPU)
    assert step.dtype == torch.int32 and step.shape[0] == len(ids) and width <= step.shape[1] < 2 * width + 16
    for i, rid in enumerate(ids):
        got = step[i, : len(blocks[rid])].tolist()
        assert got == blocks[rid], f"step table row {i} ({rid}): {got} != {blocks[rid]}"
    return step


def test_step_tables_match_a_rebuild_through_joins_leaves_growth_and_reallocation() -> None:
    rng = random.Random(0)
    table = BlockTable(rows=2, width=2)  # small, so rows and columns grow during the test
    blocks: dict[str, list[int]] = {}
    next_block, next_id = 0, 0
    for _ in range(400):
        event = rng.random()
        if event < 0.08 or not blocks:  # a request joins
            blocks[f"r{next_id}"] = [next_block + j for j in range(rng.randint(1, 5))]
            next_block, next_id = next_block + 5, next_id + 1
        elif event < 0.13 and len(blocks) > 1:  # a request leaves
            del blocks[rng.choice(sorted(blocks))]
        elif event < 0.16:  # freed and re-allocated under the same id: a new list
            rid = rng.choice(sorted(blocks))
            blocks[rid] = [next_block]
            next_block += 1
        for rid in blocks:  # decoding: a new block now and then (the manager's list, extended)
            if rng.random() < 0.2:
                blocks[rid].append(next_block)
                next_block += 1
        ids = sorted(blocks)
        if rng.random() < 0.3 and len(ids) > 1:  # a drafter pass over part of the batch
            _check(table, rng.sample(ids, rng.randint(1, len(ids))), blocks)
        _check(table, ids, blocks)
    assert len(table._step_tables) <= STEP_TABLES


def test_a_steady_batch_copies_only_its_new_blocks() -> None:
    for context_blocks in (7, 250):  # 100 and 4,000 tokens of 16
        table = BlockTable()
        blocks = {f"r{i}": list(range(i * 1000, i * 1000 + context_blocks)) for i in range(8)}
        ids = list(blocks)
        first = _check(table, ids, blocks)
        copied = table.entries_copied
        for step in range(16):  # 16 decode steps of 16-token blocks: one new block each
            if step == 5:
                for rid in ids:
                    blocks[rid].append(blocks[rid][-1] + 1)
            assert _check(table, ids, blocks) is first  # reused in place
        assert table.entries_copied - copied == 8, "only the new block of each request copied"


def test_stale_step_tables_are_dropped_not_caught_up_forever() -> None:
    table = BlockTable()
    blocks = {f"r{i}": [i] for i in range(4)}
    ids = list(blocks)
    _check(table, ids[:1], blocks)  # a step table that is never used again
    for step in range(200):
        blocks[ids[step % 4]].append(100 + step)
        _check(table, ids, blocks)
    assert len(table._log) <= max(t.tensor.numel() for t in table._step_tables)
    assert not any(
        np.array_equal(t.rows, table.update(ids[:1], [blocks[ids[0]]])) for t in table._step_tables
    )


def test_steps_without_a_step_table_keep_no_write_log() -> None:
    """A prefill-only worker never asks for a decode step table: nothing may pile up for one."""
    table = BlockTable()
    blocks = {"r0": [0]}
    for step in range(100):
        blocks["r0"].append(step + 1)
        table.update(["r0"], [blocks["r0"]])
    assert table._log == []
