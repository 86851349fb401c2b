"""From a step's scheduled requests (host data) to the device tensors the model reads.

Used by the model runner for each step and by the MTP drafter for its own passes. Tokens are laid out
decode requests first (at most ``decode_query_len`` new tokens each: absorbed attention over the paged
cache), then prefill chunks (expanded attention), which is the order ``AttentionMetadata`` promises
the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepinfer.engine.sched_output import ScheduledRequest
from deepinfer.model.attn_metadata import (
    CONTEXT_TILE_TOKENS,
    AttentionMetadata,
    ContextTile,
    DecodeMetadata,
    PrefillMetadata,
)
from deepinfer.worker.block_table import BlockTable


@dataclass(slots=True)
class StepInputs:
    """The device tensors of one step and where each request's tokens sit in them."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    token_offsets: list[int]  # first token index of each request in ``order``


class InputBuilder:
    def __init__(
        self,
        block_size: int,
        device: torch.device,
        decode_query_len: int = 1,
        context_tile: int = CONTEXT_TILE_TOKENS,
    ) -> None:
        """``decode_query_len``: requests computing at most this many tokens (one plus their drafts)
        take the absorbed decode path; ``context_tile``: keys per tile of a long cached context."""
        if context_tile < 1:
            raise ValueError(f"context_tile must be >= 1, got {context_tile}")
        self.block_size = block_size
        self.device = device
        self.decode_query_len = decode_query_len
        self.context_tile = context_tile
        self.block_table = BlockTable()

    def prepare(self, requests: Sequence[ScheduledRequest]) -> StepInputs:
        """Tensors of one step on the device: decode requests first, then prefill chunks."""
        decode = [r for r in requests if r.num_new_tokens <= self.decode_query_len]
        prefill = [r for r in requests if r.num_new_tokens > self.decode_query_len]
        order = decode + prefill
        bs = self.block_size
        query_lens = np.array([r.num_new_tokens for r in order], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in order], dtype=np.int64)
        seq_lens = starts + query_lens
        offsets = np.concatenate(([0], np.cumsum(query_lens)))
        rows = self.block_table.update([r.request_id for r in order], [r.block_ids for r in order])
        table = self.block_table.array  # [rows, width] int32; request i's blocks are row rows[i]

        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        positions = starts[req_of_token] + (np.arange(offsets[-1]) - offsets[req_of_token])
        slots = table[rows[req_of_token], positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(
            (t for r in order for t in r.token_ids), dtype=np.int64, count=int(offsets[-1])
        )

        dev = self.device
        decode_meta = prefill_meta = None
        num_decode = len(decode)
        if decode:
            decode_meta = DecodeMetadata(
                num_tokens=int(offsets[num_decode]),
                block_table=self.block_table.step_table(
                    rows[:num_decode], max(len(r.block_ids) for r in decode), dev
                ),
                seq_lens=torch.from_numpy(seq_lens[:num_decode].astype(np.int32)).to(dev),
                query_start_loc=torch.from_numpy(offsets[: num_decode + 1].astype(np.int32)).to(dev),
                max_query_len=int(query_lens[:num_decode].max()),
            )
        if prefill:
            p_q, p_k = query_lens[num_decode:], seq_lens[num_decode:]
            context_slots = None
            if (starts[num_decode:] > 0).any():
                context_slots = np.concatenate(
                    [
                        table[rows[i], np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                        for i, n in enumerate(p_k, num_decode)
                    ]
                )
                context_slots = torch.from_numpy(context_slots).to(dev)
            prefill_meta = PrefillMetadata(
                cu_seqlens_q=torch.from_numpy(np.concatenate(([0], np.cumsum(p_q))).astype(np.int32)).to(dev),
                cu_seqlens_k=torch.from_numpy(np.concatenate(([0], np.cumsum(p_k))).astype(np.int32)).to(dev),
                max_seqlen_q=int(p_q.max()),
                max_seqlen_k=int(p_k.max()),
                context_slots=context_slots,
                context_tiles=self._context_tiles(rows[num_decode:], starts[num_decode:], p_q),
            )
        meta = AttentionMetadata(torch.from_numpy(slots).to(dev), decode_meta, prefill_meta)
        floors = np.array([r.write_floor for r in order], dtype=np.int64)
        if floors.any():  # SWA replay (kvstore): full-attention layers keep the cached rows below the floor
            meta.full_slot_mapping = torch.from_numpy(
                np.where(positions < floors[req_of_token], -1, slots)
            ).to(dev)
        return StepInputs(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            meta,
            order,
            offsets[:-1].tolist(),
        )

    def advance(self, inputs: StepInputs, tokens: list[int], iteration: int) -> StepInputs:
        """The inputs of decode iteration ``iteration`` (>= 1) of a multi-iteration step
        (``SchedulerOutput.decode_steps``), from its first iteration's ``inputs`` (decode requests
        only, one token each): request ``i``'s token ``tokens[i]`` at its first position plus
        ``iteration``. The block table is the first iteration's (the scheduler allocated the further
        iterations' slots before it was built); host work is O(batch), independent of context length."""
        d = inputs.meta.decode
        if d is None or inputs.meta.prefill is not None or d.max_query_len != 1:
            raise ValueError("advance() continues a decode-only step of one token per request")
        bs, dev = self.block_size, self.device
        positions = [r.num_computed_tokens + iteration for r in inputs.order]
        slots = [r.block_ids[p // bs] * bs + p % bs for r, p in zip(inputs.order, positions)]
        meta = AttentionMetadata(
            torch.tensor(slots, dtype=torch.int64, device=dev),
            DecodeMetadata(
                num_tokens=d.num_tokens,
                block_table=d.block_table,
                seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
                query_start_loc=d.query_start_loc,
                max_query_len=1,
            ),
            None,
        )
        return StepInputs(
            torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            inputs.order,
            inputs.token_offsets,
        )

    def _context_tiles(
        self, rows: np.ndarray, context: np.ndarray, query_lens: np.ndarray
    ) -> tuple[ContextTile, ...]:
        """Cut the prefill requests' cached context (positions ``[0, context[i])`` of request ``i``,
        concatenated in request order) into tiles of ``context_tile`` keys; none when it fits one."""
        total = int(context.sum())
        if total <= self.context_tile:
            return ()
        bs, dev = self.block_size, self.device
        cum_k = np.concatenate(([0], np.cumsum(context)))
        cum_q = np.concatenate(([0], np.cumsum(query_lens)))
        tiles = []
        for t0 in range(0, total, self.context_tile):
            t1 = min(t0 + self.context_tile, total)
            first = int(np.searchsorted(cum_k, t0, side="right")) - 1
            last = int(np.searchsorted(cum_k, t1, side="left")) - 1
            lo = np.clip(t0 - cum_k[first : last + 1], 0, None)  # each request's key range in the tile
            hi = np.minimum(t1, cum_k[first + 1 : last + 2]) - cum_k[first : last + 1]
            hi = np.maximum(hi, lo)
            pos = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
            req = np.repeat(np.arange(first, last + 1), hi - lo)
            slots = self.block_table.array[rows[req], pos // bs].astype(np.int64) * bs + pos % bs
            q_lens = query_lens[first : last + 1]
            tiles.append(
                ContextTile(
                    q_start=int(cum_q[first]),
                    q_end=int(cum_q[last + 1]),
                    slots=torch.from_numpy(slots).to(dev),
                    cu_seqlens_q=torch.from_numpy(
                        (cum_q[first : last + 2] - cum_q[first]).astype(np.int32)
                    ).to(dev),
                    cu_seqlens_k=torch.from_numpy(
                        np.concatenate(([0], np.cumsum(hi - lo))).astype(np.int32)
                    ).to(dev),
                    max_seqlen_q=int(q_lens.max()),
                    max_seqlen_k=int((hi - lo).max()),
                )
            )
        return tuple(tiles)
