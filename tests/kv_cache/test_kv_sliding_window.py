"""Sliding-window groups and several KV-cache groups agreeing on a hit (single_type.py,
coordinator.py). Block size 4 and a window of 8 tokens: a hit needs the 2 blocks before its end."""

from __future__ import annotations

from prefixserve.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from tests.helpers.kv_cache import (
    decode,
    evict_block,
    free_ids,
    make_manager,
    make_request,
    snapshot,
)

SW = [SlidingWindowSpec(sliding_window=8)]
HYBRID = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]


def cached_then_freed(mgr, num_tokens: int):
    a = make_request("a", list(range(num_tokens)))
    mgr.allocate_slots(a, num_tokens)
    mgr.free(a)
    return a


def cached_block(mgr, request, index: int, group: int = 0):
    return mgr.block_pool.cached_block_hash_to_block[group].get_one_block(
        request.block_hashes[index]
    )


def test_sliding_window_hit_needs_enough_contiguous_blocks_before_its_end():
    mgr = make_manager(groups=SW)
    a = cached_then_freed(mgr, 21)  # blocks 1..5 cached, 6 partial
    evict_block(mgr.block_pool, cached_block(mgr, a, 3))
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(21))))
    # Right to left: block 4 alone is too short a run; blocks 1, 2 cover the window.
    assert (blocks.get_block_ids(), num_computed) == (([0, 2, 3],), 12)


def test_sliding_window_blocks_before_the_window_stand_as_null():
    mgr = make_manager(groups=SW)
    cached_then_freed(mgr, 21)
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(21))))
    assert (blocks.get_block_ids(), num_computed) == (([0, 0, 0, 4, 5],), 20)


def test_sliding_window_run_from_the_start_is_a_hit_of_any_length():
    mgr = make_manager(groups=SW)
    a = cached_then_freed(mgr, 21)
    evict_block(mgr.block_pool, cached_block(mgr, a, 3))
    evict_block(mgr.block_pool, cached_block(mgr, a, 1))
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(21))))
    assert (blocks.get_block_ids(), num_computed) == (([1],), 4)


def test_sliding_window_hit_allocation_skips_the_null_block():
    mgr = make_manager(groups=SW)
    a = cached_then_freed(mgr, 21)
    evict_block(mgr.block_pool, cached_block(mgr, a, 3))
    b = make_request("b", list(range(21)))
    blocks, num_computed = mgr.get_computed_blocks(b)
    new = mgr.allocate_slots(b, 9, num_computed, blocks)
    assert new.get_block_ids() == ([7, 8, 9],)
    assert mgr.get_block_ids(b) == ([0, 2, 3, 7, 8, 9],)
    assert mgr.block_pool.null_block.ref_cnt == 1
    mgr.check_invariants()


def test_sliding_window_releases_blocks_that_fell_out_of_the_window():
    mgr = make_manager(groups=SW)
    a = make_request("a", list(range(10)))
    mgr.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    decode(mgr, a, 10)  # computed 10: the next token needs positions 3..10
    assert mgr.get_block_ids(a) == ([1, 2, 3],)
    decode(mgr, a, 11)  # computed 11: positions 4.. only, block 1 is released
    assert mgr.get_block_ids(a) == ([0, 2, 3],)
    assert free_ids(mgr.block_pool)[-1] == 1
    assert mgr.block_pool.blocks[1].block_hash == a.block_hashes[0]  # freed, not evicted
    mgr.check_invariants()


def test_sliding_window_releases_several_blocks_tail_first():
    mgr = make_manager(groups=SW)
    a = make_request("a", list(range(20)))
    mgr.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    assert mgr.allocate_slots(a, 4).get_block_ids() == ([5],)
    assert mgr.get_block_ids(a) == ([0, 0, 3, 4, 5],)
    assert free_ids(mgr.block_pool) == [6, 7, 8, 9, 10, 2, 1]
    mgr.check_invariants()


def test_sliding_window_released_blocks_count_as_free_capacity():
    mgr = make_manager(num_blocks=5, groups=SW)
    a = make_request("a", list(range(16)))
    mgr.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    assert mgr.num_free_blocks == 0
    assert decode(mgr, a, 16)
    assert mgr.get_block_ids(a) == ([0, 0, 3, 4, 2],)
    mgr.check_invariants()


def test_sliding_window_allocation_short_returns_none_without_releasing():
    mgr = make_manager(num_blocks=5, groups=SW)
    a = make_request("a", list(range(16)))
    mgr.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    a.append_output_token_ids(list(range(16, 25)))  # 3 more blocks; releasing frees only 2
    before = snapshot(mgr, [a])
    assert mgr.allocate_slots(a, 9) is None
    assert snapshot(mgr, [a]) == before


def test_groups_are_keyed_separately_in_the_map():
    mgr = make_manager(num_blocks=21, groups=HYBRID)
    a = make_request("a", list(range(13)))
    assert mgr.allocate_slots(a, 13).get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    pool = mgr.block_pool
    hash_to_block = pool.cached_block_hash_to_block
    assert [hash_to_block[0].get_one_block(h).block_id for h in a.block_hashes] == [1, 2, 3]
    assert [hash_to_block[1].get_one_block(h).block_id for h in a.block_hashes] == [5, 6, 7]
    mgr.check_invariants()


def test_hybrid_hit_when_all_groups_agree():
    mgr = make_manager(num_blocks=21, groups=HYBRID)
    cached_then_freed(mgr, 13)
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(13))))
    assert (blocks.get_block_ids(), num_computed) == (([1, 2, 3], [0, 6, 7]), 12)


def test_hybrid_hit_shortened_by_the_sliding_window_group():
    mgr = make_manager(num_blocks=21, groups=HYBRID)
    a = cached_then_freed(mgr, 13)
    evict_block(mgr.block_pool, cached_block(mgr, a, 1, group=1))
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(13))))
    assert (blocks.get_block_ids(), num_computed) == (([1], [5]), 4)


def test_hybrid_hit_shortened_by_the_full_attention_group():
    mgr = make_manager(num_blocks=21, groups=HYBRID)
    a = cached_then_freed(mgr, 13)
    evict_block(mgr.block_pool, cached_block(mgr, a, 2, group=0))
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(13))))
    assert (blocks.get_block_ids(), num_computed) == (([1, 2], [5, 6]), 8)


def test_hybrid_search_repeats_until_no_group_shortens_the_hit():
    groups = [FullAttentionSpec(), SlidingWindowSpec(8), SlidingWindowSpec(16)]
    mgr = make_manager(num_blocks=31, groups=groups)
    a = cached_then_freed(mgr, 25)  # 6 full blocks per group
    evict_block(mgr.block_pool, cached_block(mgr, a, 3, group=2))
    blocks, num_computed = mgr.get_computed_blocks(make_request("b", list(range(25))))
    # The 16-token window needs 4 blocks: only the 3 leading ones qualify (12 tokens). The
    # 8-token window first agreed on 24 tokens, and must search again under 12.
    assert num_computed == 12
    full, sw8, sw16 = blocks.get_block_ids()
    assert full == [1, 2, 3] and sw16 == [15, 16, 17]
    assert sw8[0] == 0 and 0 not in sw8[1:] and len(sw8) == 3


def test_hybrid_allocate_and_free_keep_invariants():
    mgr = make_manager(num_blocks=21, groups=HYBRID)
    cached_then_freed(mgr, 13)
    b = make_request("b", list(range(13)))
    blocks, num_computed = mgr.get_computed_blocks(b)
    new = mgr.allocate_slots(b, 1, num_computed, blocks)
    assert new.get_block_ids() == ([9], [10])
    assert mgr.get_block_ids(b) == ([1, 2, 3, 9], [0, 6, 7, 10])
    mgr.check_invariants()
    mgr.free(b)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 20
