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
from deepinfer.model.attn_metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata


@dataclass(slots=True)
class StepInputs:
    """The device tensors of one step and where each request's tokens sit in them."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    token_offsets: list[int]  # first token index of each request in ``order``


class InputBuilder:
    def __init__(self, block_size: int, device: torch.device, decode_query_len: int = 1) -> None:
        """``decode_query_len``: requests computing at most this many tokens (one plus their drafts)
        take the absorbed decode path."""
        self.block_size = block_size
        self.device = device
        self.decode_query_len = decode_query_len

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
        width = max(len(r.block_ids) for r in order)
        table = np.zeros((len(order), width), dtype=np.int64)
        for i, r in enumerate(order):
            table[i, : len(r.block_ids)] = r.block_ids

        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        positions = starts[req_of_token] + (np.arange(offsets[-1]) - offsets[req_of_token])
        slots = table[req_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter(
            (t for r in order for t in r.token_ids), dtype=np.int64, count=int(offsets[-1])
        )

        dev = self.device
        decode_meta = prefill_meta = None
        num_decode = len(decode)
        if decode:
            decode_meta = DecodeMetadata(
                num_tokens=int(offsets[num_decode]),
                block_table=torch.from_numpy(table[:num_decode].astype(np.int32)).to(dev),
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
                        table[i, np.arange(n) // bs] * bs + np.arange(n) % bs
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
