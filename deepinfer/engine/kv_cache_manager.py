"""Which KV-cache blocks each request holds, and the prefix cache.

Owned by the Scheduler. Requests are given blocks for the tokens they are about to compute; full
blocks are hashed as a chain (``hash(parent_hash, token ids of the block)``) and registered so that a
later request with the same prefix reuses them instead of recomputing. The scheduler only ever sees
block ids; the tensors behind them belong to the model runner.
"""

from __future__ import annotations

import hashlib
from array import array

from deepinfer.engine.block_pool import BlockPool, KVBlock
from deepinfer.engine.request import Request


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Stable across processes (SHA-256), so it can name blocks in an external KV store."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()[:16]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same blocks' ids, extended alongside
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ------------------------------------------------------------------ queries
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order: the manager's own list, which only grows while the
        request holds its blocks (a new list after it is freed), so readers can track it by
        differences. Callers must not modify it."""
        return self._block_ids.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Blocks of the longest cached prefix of the request's tokens, leaving at least one token
        to compute (its logits are needed). None for a request that asks for prompt log-probabilities:
        a cached position's logits are never computed, so every position is. Takes no references."""
        if not self.pool.enable_prefix_caching:
            return []
        self._update_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """Count one admission's prefix-cache lookup (the hit-rate counters): called once when the
        request is admitted, not on every attempt to schedule it while it waits for room."""
        if self.pool.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_cached_tokens

    # ------------------------------------------------------------------ allocation
    def allocate(
        self, request: Request, num_new_tokens: int, cached: list[KVBlock] | None = None, lookahead: int = 0
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its computed tokens and
        the ``cached`` prefix blocks, which it then references), plus ``lookahead`` slots beyond them
        (where speculative drafts are computed). Returns False, changing nothing, when there are not
        enough free blocks."""
        cached = cached or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed = -(-(num_computed + num_new_tokens + lookahead) // self.block_size) - len(held) - len(cached)
        reclaimable = sum(1 for b in cached if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimable:
            return False
        self.pool.take(cached)
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks.extend(cached)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        ids = self._block_ids.setdefault(request.request_id, [])
        ids.extend(b.block_id for b in blocks[len(ids) :])
        self._register_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash-register the blocks whose tokens will all be computed after this step."""
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(request)
        blocks = self._blocks[request.request_id]
        start = self._num_hashed.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.register(blocks[i], request.block_hashes[i])
        self._num_hashed[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first: its tail is then evicted before its
        prefix, which is the part other requests are likely to share."""
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))
