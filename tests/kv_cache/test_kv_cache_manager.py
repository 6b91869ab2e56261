"""Rules of the KVCacheManager with one full-attention group (kv_cache_manager.py)."""

from __future__ import annotations

import pytest

from prefixserve.core.kv_cache.events import BlockStored
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheBlocks
from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from tests.helpers.kv_cache import (
    decode,
    evict_block,
    free_ids,
    make_manager,
    make_request,
    schedule,
    snapshot,
)


def test_first_request_misses_and_gets_blocks_from_the_head():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    blocks, num_computed = mgr.get_computed_blocks(a)
    assert (blocks.get_block_ids(), num_computed) == (([],), 0)
    new = mgr.allocate_slots(a, 10, num_computed, blocks)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert mgr.get_block_ids(a) == ([1, 2, 3],)
    assert mgr.num_free_blocks == 7 and mgr.num_kv_blocks == 10
    mgr.check_invariants()


def test_last_token_always_computed():
    mgr = make_manager()
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    b = make_request("b", list(range(8)))  # both blocks cached, but the hit stops at 7 tokens
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert (blocks.get_block_ids(), num_computed) == (([1],), 4)


def test_hits_are_contiguous_only():
    mgr = make_manager(num_blocks=5)
    a = make_request("a", list(range(13)))
    schedule(mgr, a)
    mgr.free(a)
    pool = mgr.block_pool
    assert free_ids(pool) == [4, 3, 2, 1]
    evict_block(pool, pool.blocks[2])  # the middle block of the chain
    assert pool.get_cached_block(a.block_hashes[2], 0, [8, 9, 10, 11]) is pool.blocks[3]
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(13))))
    assert (blocks.get_block_ids(), num_computed) == (([1],), 4)


def test_only_full_blocks_are_hashed():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    hashes = [b.block_hash for b in mgr.get_blocks(a).blocks[0]]
    assert hashes == [a.block_hashes[0], a.block_hashes[1], None]
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(11))))
    assert num_computed == 8


def test_identical_prompt_same_step_hits():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(10)))
    # Scheduled in the same step: a's slots are allocated, nothing is computed yet.
    blocks_a, n_a = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 10 - n_a, n_a, blocks_a) is not None
    blocks_b, n_b = mgr.get_computed_blocks(b)
    assert (blocks_b.get_block_ids(), n_b) == (([1, 2],), 8)
    assert mgr.allocate_slots(b, 2, n_b, blocks_b).get_block_ids() == ([4],)
    assert mgr.get_block_ids(b) == ([1, 2, 4],)
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[1:5]] == [2, 2, 1, 1]
    mgr.check_invariants()


def test_allocate_short_returns_none_without_side_effects():
    mgr = make_manager(num_blocks=5, events=True)
    a = make_request("a", list(range(16)))
    schedule(mgr, a)
    assert mgr.num_free_blocks == 0
    before = snapshot(mgr, [a])
    a.append_output_token_ids(99)
    assert mgr.allocate_slots(a, 1) is None
    assert snapshot(mgr, [a]) == before


def test_hit_blocks_with_ref_zero_count_as_needed_capacity():
    mgr = make_manager(num_blocks=5)
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    mgr.free(a)
    c = make_request("c", list(range(100, 108)))
    schedule(mgr, c)
    assert free_ids(mgr.block_pool) == [2, 1]
    b = make_request("b", list(range(12)))
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert (blocks.get_block_ids(), num_computed) == (([1, 2],), 8)
    # One fresh block plus the two hits that must leave the free queue: 3 > 2 free.
    before = snapshot(mgr, [b, c])
    assert mgr.allocate_slots(b, 4, num_computed, blocks) is None
    assert snapshot(mgr, [b, c]) == before
    mgr.free(c)
    assert free_ids(mgr.block_pool) == [2, 1, 4, 3]
    assert mgr.allocate_slots(b, 4, num_computed, blocks).get_block_ids() == ([4],)
    assert mgr.get_block_ids(b) == ([1, 2, 4],)
    assert free_ids(mgr.block_pool) == [3]
    mgr.check_invariants()


def test_get_computed_blocks_has_no_side_effects():
    mgr = make_manager(events=True)
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    mgr.free(a)
    before = snapshot(mgr)
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(10))))
    assert num_computed == 8
    assert snapshot(mgr) == before


def test_free_is_tail_first():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    mgr.free(a)
    assert free_ids(mgr.block_pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert mgr.get_block_ids(a) == ([],)
    mgr.free(a)  # freeing twice is harmless
    mgr.check_invariants()


def test_eviction_order_is_lru_last_block_of_oldest_freed_request_first():
    mgr = make_manager()
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    schedule(mgr, a)
    schedule(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr.block_pool) == [5, 6, 7, 8, 9, 10, 2, 1, 4, 3]
    c = make_request("c", list(range(200, 228)))  # 7 blocks: the 6 uncached ones, then block 2
    schedule(mgr, c)
    assert mgr.get_block_ids(c) == ([5, 6, 7, 8, 9, 10, 2],)
    blocks, num_computed = mgr.get_computed_blocks(make_request("a2", list(range(9))))
    assert (blocks.get_block_ids(), num_computed) == (([1],), 4)
    blocks, num_computed = mgr.get_computed_blocks(make_request("b2", list(range(100, 109))))
    assert (blocks.get_block_ids(), num_computed) == (([3, 4],), 8)


def test_chunked_prefill_caches_blocks_as_chunks_complete():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    assert mgr.allocate_slots(a, 5).get_block_ids() == ([1, 2],)
    assert [b.block_hash is not None for b in mgr.get_blocks(a).blocks[0]] == [True, False]
    a.num_computed_tokens = 5
    assert mgr.allocate_slots(a, 5).get_block_ids() == ([3],)
    assert [b.block_hash is not None for b in mgr.get_blocks(a).blocks[0]] == [True, True, False]
    mgr.check_invariants()


def test_lookahead_tokens_get_slots_but_are_never_cached():
    mgr = make_manager()
    a = make_request("a", list(range(6)))
    new = mgr.allocate_slots(a, 6, num_lookahead_tokens=3)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, False, False]
    a.num_computed_tokens = 6
    a.append_output_token_ids([6, 7])  # block 2 becomes full: cached by the next allocation
    assert mgr.allocate_slots(a, 2, num_lookahead_tokens=3).get_block_ids() == ([],)
    assert [b.block_hash is not None for b in mgr.get_blocks(a).blocks[0]] == [True, True, False]


def test_decode_caches_a_block_when_it_fills():
    mgr = make_manager()
    a = make_request("a", list(range(7)))
    schedule(mgr, a)
    assert decode(mgr, a, 7)
    assert mgr.get_block_ids(a) == ([1, 2],)
    assert mgr.get_blocks(a).blocks[0][1].block_hash == a.block_hashes[1]
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(9))))
    assert (blocks.get_block_ids(), num_computed) == (([1, 2],), 8)
    assert decode(mgr, a, 8)
    assert mgr.get_block_ids(a) == ([1, 2, 3],)


def test_preempted_request_hits_its_own_blocks_again_and_is_counted_apart():
    mgr = make_manager()
    a = make_request("a", list(range(6)))
    schedule(mgr, a)
    for token in (6, 7, 8):
        decode(mgr, a, token)
    mgr.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    blocks, num_computed = mgr.get_computed_blocks(a)
    assert (blocks.get_block_ids(), num_computed) == (([1, 2],), 8)
    assert mgr.allocate_slots(a, 1, num_computed, blocks).get_block_ids() == ([4],)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 6, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)


def test_prefix_cache_stats_count_each_admission_once():
    mgr = make_manager(num_blocks=5)
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    decode(mgr, a, 10)  # a running request's allocations are not lookups
    b = make_request("b", list(range(10)))
    schedule(mgr, b)
    c = make_request("c", list(range(100, 120)))
    assert schedule(mgr, c) is None  # failed admissions are not counted
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert (stats.preempted_requests, stats.hash_collisions) == (0, 0)


def test_skip_reading_prefix_cache_still_writes_blocks():
    mgr = make_manager()
    schedule(mgr, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)), sampling_params=SamplingParams(prompt_logprobs=1))
    assert b.skip_reading_prefix_cache
    blocks, num_computed = mgr.get_computed_blocks(b)
    assert (blocks.get_block_ids(), num_computed) == (([],), 0)
    schedule(mgr, b)
    assert mgr.get_block_ids(b) == ([4, 5, 6],)
    assert [blk.block_hash for blk in mgr.get_blocks(b).blocks[0][:2]] == b.block_hashes
    assert mgr.make_prefix_cache_stats().requests == 1
    mgr.check_invariants()


def test_caching_disabled_never_hits_nor_hashes():
    mgr = make_manager(enable_caching=False)
    schedule(mgr, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)))
    assert mgr.get_computed_blocks(b)[1] == 0
    schedule(mgr, b)
    assert all(blk.block_hash is None for blk in mgr.block_pool.blocks)
    assert mgr.make_prefix_cache_stats().requests == 0
    mgr.check_invariants()


def test_cache_salt_isolates_prefixes():
    mgr = make_manager()
    schedule(mgr, make_request("a", list(range(10)), cache_salt="tenant-1"))
    assert mgr.get_computed_blocks(make_request("b", list(range(10))))[1] == 0
    assert mgr.get_computed_blocks(make_request("c", list(range(10)), cache_salt="t-2"))[1] == 0
    hit = mgr.get_computed_blocks(make_request("d", list(range(10)), cache_salt="tenant-1"))
    assert hit[1] == 8


def test_hash_collision_is_a_miss_in_lookups():
    mgr = make_manager()
    a = make_request("a", list(range(8)), hash_fn=lambda data: data[-4:])  # the last token
    schedule(mgr, a)
    b = make_request("b", [9, 9, 9, 3, 9, 9, 9, 7, 0], hash_fn=lambda data: data[-4:])
    assert b.block_hashes == a.block_hashes
    assert mgr.get_computed_blocks(b)[1] == 0
    assert mgr.make_prefix_cache_stats().hash_collisions == 1


def test_usage_is_fraction_of_blocks_in_use():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    assert mgr.usage == pytest.approx(0.3)
    mgr.free(a)
    assert mgr.usage == 0.0


def test_reset_prefix_cache_fails_while_running_then_forgets_everything():
    mgr = make_manager(events=True)
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", list(range(10))))[1] == 0


def test_kv_events_one_block_stored_per_caching_call():
    mgr = make_manager(events=True)
    a = make_request("a", list(range(10)), lora_name="lora-a")
    schedule(mgr, a)
    assert mgr.take_events() == [
        BlockStored(
            block_hashes=a.block_hashes,
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_name="lora-a",
            extra_keys=[("lora-a",), ("lora-a",)],
            group_idx=0,
        )
    ]


def test_allocate_rejects_negative_token_counts():
    mgr = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        mgr.allocate_slots(make_request("a", [1]), -1)


def test_kv_cache_blocks_helpers():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    blocks = mgr.get_blocks(a)
    assert (blocks + mgr.empty_blocks()).get_block_ids() == ([1, 2, 3],)
    assert blocks.num_blocks == 3
    assert KVCacheBlocks(()).num_blocks == 0


def test_check_invariants_catches_a_ref_count_that_disagrees_with_holders():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    mgr.block_pool.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref count 2 but 1 holders"):
        mgr.check_invariants()


def test_request_without_block_hasher_is_allocated_but_not_cached():
    mgr = make_manager()
    a = Request("a", list(range(10)), SamplingParams())
    assert mgr.allocate_slots(a, 10).get_block_ids() == ([1, 2, 3],)
    assert all(blk.block_hash is None for blk in mgr.block_pool.blocks)
    mgr.check_invariants()


def test_many_duplicates_of_one_prompt_stay_consistent():
    mgr = make_manager(num_blocks=41)
    for i in range(30):  # prompt_logprobs requests never read the cache: each caches a copy
        r = make_request(f"r{i}", list(range(8)), sampling_params=SamplingParams(prompt_logprobs=0))
        schedule(mgr, r)
        mgr.free(r)
        mgr.check_invariants()
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(9))))
    first = mgr.block_pool.cached_block_hash_to_block[0].get_one_block(
        blocks.blocks[0][0].block_hash
    )
    assert num_computed == 8 and blocks.blocks[0][0] is first


def test_allocate_rejects_computed_tokens_without_their_blocks():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    b = make_request("b", list(range(10)))
    blocks, num_computed = mgr.get_computed_blocks(b)
    with pytest.raises(ValueError, match="num_new_computed_tokens=4 must equal"):
        mgr.allocate_slots(b, 6, 4, blocks)
    with pytest.raises(ValueError, match="num_new_computed_tokens=8 must equal"):
        mgr.allocate_slots(b, 2, 8)
    mgr.check_invariants()


def test_uncomputed_blocks_of_a_failed_step_are_never_hit():
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    assert schedule(mgr, a, 4) == 0  # step 1 computes block 0
    assert mgr.allocate_slots(a, 6) is not None  # step 2 allocates (and caches) block 1 ...
    assert mgr.get_computed_blocks(make_request("x", list(range(10))))[1] == 8
    mgr.uncache_uncomputed_blocks(a, 4)  # ... but its forward pass failed
    mgr.free(a)
    blocks, n = mgr.get_computed_blocks(make_request("b", list(range(10))))
    assert (blocks.get_block_ids(), n) == (([1],), 4)  # block 0 was computed: still a hit
    assert mgr.num_free_blocks == mgr.num_kv_blocks
    mgr.check_invariants()
