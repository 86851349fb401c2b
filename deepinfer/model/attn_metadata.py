"""Per-step attention metadata: built by the model runner, read by every MLA layer.

Lives on the model's device. The step's tokens are ordered decode tokens first (requests computing
only a few tokens: absorbed attention over the paged cache), then prefill tokens (chunks of prompts:
expanded attention). Built once per step and shared by all layers; layers never modify it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

# Keys per context tile: a prefill chunk over more cached context than this is attended tile by tile
# (each tile's latents expanded through kv_b_proj, results merged by log-sum-exp), so the expanded keys
# and values held at once never exceed this many tokens, however long the context.
CONTEXT_TILE_TOKENS = 2048


@dataclass(slots=True)
class DecodeMetadata:
    """Arguments of ``ops.mla_decode`` for the first ``num_tokens`` tokens of the step."""

    num_tokens: int
    block_table: Tensor  # [B, >= max_blocks] int32; kept across steps, updated in place (BlockTable)
    seq_lens: Tensor  # [B] int32, including this step's tokens
    query_start_loc: Tensor  # [B+1] int32
    max_query_len: int


@dataclass(slots=True)
class ContextTile:
    """One tile of the prefill requests' cached context: at most ``CONTEXT_TILE_TOKENS`` keys in all,
    from a run of consecutive prefill requests, for ``ops.mla_prefill_partial(causal=False)``.

    The run's queries are prefill tokens ``[q_start, q_end)`` (indices among the step's prefill tokens);
    ``cu_seqlens_k`` may give a request of the run no keys.
    """

    q_start: int
    q_end: int
    slots: Tensor  # [keys] int64 cache slots of the tile's keys, request by request
    cu_seqlens_q: Tensor  # [b+1] int32, relative to q_start
    cu_seqlens_k: Tensor  # [b+1] int32
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(slots=True)
class PrefillMetadata:
    """Arguments of ``ops.mla_prefill`` for the remaining tokens of the step.

    ``context_slots`` lists, per request, the cache slots of ALL its keys (cached context, then this
    step's tokens), to be read back with ``kv_cache_gather``; it is None when no request has cached
    context, in which case the keys are exactly this step's tokens. ``context_tiles`` is non-empty
    when the requests' cached context exceeds ``CONTEXT_TILE_TOKENS`` in all: full-attention layers
    then attend this step's tokens causally and each tile of the context apart, and merge the pieces
    (sliding-window layers still read ``context_slots``).
    """

    cu_seqlens_q: Tensor  # [B+1] int32
    cu_seqlens_k: Tensor  # [B+1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    context_slots: Tensor | None  # [sum of key lengths] int64
    context_tiles: tuple[ContextTile, ...] = ()


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
