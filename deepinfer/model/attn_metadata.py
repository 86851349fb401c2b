"""Per-step attention metadata: built by the model runner, read by every MLA layer.

Lives on the model's device. The step's tokens are ordered decode tokens first (requests computing
only a few tokens: absorbed attention over the paged cache), then prefill tokens (chunks of prompts:
expanded attention). Built once per step and shared by all layers; layers never modify it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(slots=True)
class DecodeMetadata:
    """Arguments of ``ops.mla_decode`` for the first ``num_tokens`` tokens of the step."""

    num_tokens: int
    block_table: Tensor  # [B, max_blocks] int32
    seq_lens: Tensor  # [B] int32, including this step's tokens
    query_start_loc: Tensor  # [B+1] int32
    max_query_len: int


@dataclass(slots=True)
class PrefillMetadata:
    """Arguments of ``ops.mla_prefill`` for the remaining tokens of the step.

    ``context_slots`` lists, per request, the cache slots of ALL its keys (cached context, then this
    step's tokens), to be read back with ``kv_cache_gather``; it is None when no request has cached
    context, in which case the keys are exactly this step's tokens.
    """

    cu_seqlens_q: Tensor  # [B+1] int32
    cu_seqlens_k: Tensor  # [B+1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    context_slots: Tensor | None  # [sum of key lengths] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64, negative = padding token (not written)
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    # Slots full-attention layers write, when some tokens are below a request's write floor (SWA
    # replay after a KV-store hit: those rows are cached and shared, so they are not rewritten).
    full_slot_mapping: Tensor | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.decode.num_tokens if self.decode is not None else 0
