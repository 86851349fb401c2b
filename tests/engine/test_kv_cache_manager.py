"""Block pool and KV-cache manager: allocation, reference counts, prefix hits, eviction order."""

from __future__ import annotations

import pytest

from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.kv_cache_manager import KVCacheManager, hash_block
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(
        rid, tokens, SamplingParams(), seed=0, max_tokens=8, eos_token_ids=frozenset(), arrival_time=0.0
    )


def test_hashes_chain_over_the_prefix() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_allocate_grows_by_blocks_and_refuses_without_changing_anything() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    r = req("a", list(range(10)))
    assert kv.allocate(r, 10)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 1
    r.num_computed_tokens = 10
    assert not kv.allocate(r, 7)  # needs 2 more blocks, 1 free
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 1
    assert kv.allocate(r, 2)
    kv.free(r)
    assert kv.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = req("a", list(range(12)))
    assert kv.allocate(first, 12)
    second = req("b", list(range(12)))
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]  # 3 full blocks, but one token must remain
    assert kv.allocate(second, 4, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 8


def test_freed_blocks_stay_cached_until_reused_and_tails_go_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate(a, 6)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert len(kv.find_cached_prefix(req("b", [1, 2, 3, 4, 5, 6, 7]))) == 3
    # Taking one fresh block evicts the never-hashed spare first, then a's tail block.
    kv.pool.allocate(2)
    assert len(kv.find_cached_prefix(req("c", [1, 2, 3, 4, 5, 6, 7]))) == 2


def test_release_more_than_taken_is_an_error() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])
