"""Rules of the BlockPool (prefixserve/kv_cache/block_pool.py)."""

from __future__ import annotations

import pytest

from prefixserve.core.kv_cache.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.helpers.kv_cache import free_ids, make_request


def cached_pool(num_blocks: int = 9, events: bool = True):
    """A pool whose blocks 1, 2 are cached for an 8-token request and then freed tail first."""
    pool = BlockPool(num_blocks, enable_kv_cache_events=events)
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4)
    pool.free_blocks(reversed(blocks))
    return pool, request, blocks


def test_blocks_are_created_once_with_slots():
    pool = BlockPool(5)
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
    assert not hasattr(pool.blocks[1], "__dict__")
    ids = [id(b) for b in pool.blocks]
    pool.free_blocks(reversed(pool.get_new_blocks(4)))
    assert [id(b) for b in pool.blocks] == ids


def test_null_block_is_never_allocated_or_freed():
    pool = BlockPool(4)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.num_kv_blocks == 3 and pool.get_num_free_blocks() == 3
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 0
    pool.check_invariants()


def test_free_queue_popleft_append_remove_are_linked_in_place():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 2, 0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 3]
    assert queue.num_free_blocks == 3
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    queue.popleft_n(3)
    with pytest.raises(ValueError):
        queue.popleft()


def test_free_queue_append_n_keeps_the_order_given_and_popleft_n_never_pops_part():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks[:1])
    queue.append_n(blocks[1:])
    assert queue.block_ids() == [0, 1, 2, 3] and queue.num_free_blocks == 4
    with pytest.raises(ValueError, match="only 4 are free"):
        queue.popleft_n(5)
    assert queue.block_ids() == [0, 1, 2, 3] and queue.num_free_blocks == 4


def cached_block(block_id: int, block_hash: bytes, token_ids: list[int], group_id: int = 0):
    """A block carrying what the pool sets before inserting it in a map."""
    block = KVCacheBlock(block_id)
    block.block_hash, block.token_ids, block.group_id = block_hash, token_ids, group_id
    return block


def test_hash_map_finds_the_first_inserted_copy_and_promotes_the_oldest_when_it_is_popped():
    a, b, c, d = (cached_block(i, b"h", [1, 2]) for i in range(1, 5))
    hash_to_block = BlockHashToBlockMap(0)
    hash_to_block.insert([a, b, c, d])
    hash_to_block.insert([c, a, KVCacheBlock(9)])  # mapped already, or no hash: nothing moves
    assert dict(hash_to_block.items()) == {b"h": [a, b, c, d]}
    assert hash_to_block.get_one_block(b"h") is a and len(hash_to_block) == 1
    hash_to_block.pop([c])  # a later copy leaves from the middle of the line
    hash_to_block.pop([a])
    assert dict(hash_to_block.items()) == {b"h": [b, d]}
    hash_to_block.pop([b, d])
    assert hash_to_block.get_one_block(b"h") is None and len(hash_to_block) == 0


def test_hash_map_get_needs_equal_token_ids_and_counts_a_collision_only_when_no_copy_has_them():
    first, later = cached_block(1, b"h", [1, 2]), cached_block(2, b"h", [3, 4])
    hash_to_block = BlockHashToBlockMap(0)
    hash_to_block.insert([first, later])
    assert hash_to_block.get(b"h", [1, 2]) is first
    assert hash_to_block.get(b"h", [3, 4]) is later and hash_to_block.num_collisions == 0
    assert hash_to_block.get(b"h", [5, 6]) is None and hash_to_block.num_collisions == 1
    assert hash_to_block.get(b"other", [1, 2]) is None and hash_to_block.num_collisions == 1


def test_hash_map_pop_clears_what_it_unmaps_and_skips_blocks_it_does_not_map():
    mine = cached_block(1, b"h", [1], group_id=1)
    other_group = cached_block(2, b"h", [1], group_id=0)
    uncached = KVCacheBlock(3)
    hash_to_block = BlockHashToBlockMap(1)
    hash_to_block.insert([mine])
    hash_to_block.pop([other_group, uncached, mine])
    assert (mine.block_hash, mine.token_ids, mine.group_id) == (None, None, -1)
    assert (other_group.block_hash, other_group.group_id) == (b"h", 0)
    assert len(hash_to_block) == 0


def test_get_new_blocks_pops_from_the_head_with_ref_one():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    assert [(b.block_id, b.ref_cnt) for b in blocks] == [(1, 1), (2, 1)]
    assert free_ids(pool) == [3, 4, 5]


def test_asking_more_blocks_than_free_is_an_error_not_a_partial_result():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a, b])
    assert free_ids(pool) == [4, 5, 3, 1, 2]


def test_free_drops_one_ref_and_queues_only_at_zero():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [2, 3, 1]


def test_free_does_not_evict():
    pool, request, blocks = cached_pool()
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 2, 1]
    assert [b.block_hash for b in blocks] == request.block_hashes
    assert pool.get_cached_block(request.block_hashes[0], 0, [1, 2, 3, 4]) is blocks[0]
    assert pool.get_cached_block(request.block_hashes[1], 0, [5, 6, 7, 8]) is blocks[1]


def test_eviction_happens_when_a_cached_block_is_popped():
    pool, request, blocks = cached_pool()
    pool.take_events()
    pool.get_new_blocks(6)  # the uncached blocks 3..8: nothing evicted
    assert pool.take_events() == []
    (popped,) = pool.get_new_blocks(1)
    assert popped is blocks[1] and popped.block_hash is None and popped.token_ids is None
    assert pool.get_cached_block(request.block_hashes[1], 0, [5, 6, 7, 8]) is None
    assert pool.get_cached_block(request.block_hashes[0], 0, [1, 2, 3, 4]) is blocks[0]
    assert pool.take_events() == [BlockRemoved(block_hashes=[request.block_hashes[1]], group_idx=0)]
    pool.check_invariants()


def test_touch_takes_a_free_block_off_the_queue_from_anywhere():
    pool, request, blocks = cached_pool()
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 2
    pool.check_invariants()


def test_duplicate_blocks_not_deduplicated_lookup_returns_first():
    pool = BlockPool(6)
    a = make_request("a", [1, 2, 3, 4])
    b = make_request("b", [1, 2, 3, 4])
    (first,) = pool.get_new_blocks(1)
    (second,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [first], 0, 1, 4)
    pool.cache_full_blocks(b, [second], 0, 1, 4)
    assert first.block_hash == second.block_hash == a.block_hashes[0]
    assert pool.get_cached_block(a.block_hashes[0], 0, [1, 2, 3, 4]) is first
    pool.check_invariants()
    # When the first copy is evicted, the next one inserted takes its place.
    pool.free_blocks([first, second])
    pool.get_new_blocks(3)
    assert pool.get_new_blocks(1) == [first]
    assert pool.get_cached_block(a.block_hashes[0], 0, [1, 2, 3, 4]) is second
    pool.check_invariants()


def test_cache_full_blocks_skips_already_cached_and_uncached_range():
    pool, request, blocks = cached_pool()
    pool.take_events()
    pool.cache_full_blocks(request, blocks, 0, 2, 4)  # both already carry their hash
    pool.cache_full_blocks(request, blocks, 2, 2, 4)
    assert pool.take_events() == []
    assert [len(b) for _, b in pool.cached_block_hash_to_block[0].items()] == [1, 1]


def test_block_stored_event_payload():
    pool = BlockPool(9, enable_kv_cache_events=True)
    request = make_request("r", list(range(12)), lora_name="lora-x")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 1, 4)
    pool.cache_full_blocks(request, blocks, 1, 3, 4, extra_keys_fn=lambda r, s, e: (s, e))
    assert pool.take_events() == [
        BlockStored(
            block_hashes=request.block_hashes[:1],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=4,
            lora_name="lora-x",
            extra_keys=[None],
            group_idx=0,
        ),
        BlockStored(
            block_hashes=request.block_hashes[1:3],
            parent_block_hash=request.block_hashes[0],
            token_ids=list(range(4, 12)),
            block_size=4,
            lora_name="lora-x",
            extra_keys=[(4, 8), (8, 12)],
            group_idx=0,
        ),
    ]
    assert pool.take_events() == []


def test_block_stored_events_break_at_a_hit_so_each_parent_is_the_block_before():
    """A hit in the middle of the cached range: the new blocks on either side go in two events,
    the second chained to the hit (a router rebuilds each key from the event's parent)."""
    pool = BlockPool(9, enable_kv_cache_events=True)
    request = make_request("r", list(range(16)))
    blocks = pool.get_new_blocks(4)
    blocks[1].block_hash = b"already-cached"  # a hit: cache_full_blocks leaves it as it is
    pool.cache_full_blocks(request, blocks, 0, 4, 4)
    events = pool.take_events()
    assert [e.block_hashes for e in events] == [
        request.block_hashes[:1],
        request.block_hashes[2:4],
    ]
    assert [e.parent_block_hash for e in events] == [None, request.block_hashes[1]]
    assert events[1].token_ids == list(range(8, 16))


def test_events_disabled_records_nothing():
    pool, _, _ = cached_pool(events=False)
    pool.get_new_blocks(8)
    assert pool.take_events() == []


def test_reset_fails_while_blocks_in_use():
    pool, request, blocks = cached_pool()
    pool.take_events()
    (held,) = pool.get_new_blocks(1)
    mapped = pool.cached_block_hash_to_block[0]
    before = (free_ids(pool), [b.block_hash for b in pool.blocks], dict(mapped.items()))
    assert pool.reset_prefix_cache() is False
    assert (free_ids(pool), [b.block_hash for b in pool.blocks], dict(mapped.items())) == before
    assert pool.take_events() == []
    pool.free_blocks([held])


def test_reset_forgets_every_hash_and_emits_all_blocks_cleared():
    pool, request, blocks = cached_pool()
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert [len(m) for m in pool.cached_block_hash_to_block] == [0]
    assert pool.get_cached_block(request.block_hashes[0], 0, [1, 2, 3, 4]) is None
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_hash_collision_is_a_miss():
    pool = BlockPool(6)
    a = make_request("a", [1, 2, 3, 4], hash_fn=lambda data: b"same")
    b = make_request("b", [5, 6, 7, 8], hash_fn=lambda data: b"same")
    assert a.block_hashes == b.block_hashes
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [block], 0, 1, 4)
    assert pool.get_cached_block(b"same", 0, [5, 6, 7, 8]) is None
    assert pool.num_hash_collisions == 1
    assert pool.get_cached_block(b"same", 0, [1, 2, 3, 4]) is block
    # A colliding block cached later is found past the first one.
    (other,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [other], 0, 1, 4)
    assert pool.get_cached_block(b"same", 0, [5, 6, 7, 8]) is other
    assert pool.num_hash_collisions == 1
    pool.check_invariants()


def test_usage_is_fraction_of_allocatable_blocks_in_use():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    pool.get_new_blocks(1)
    assert pool.usage == 0.25


def test_check_invariants_catches_a_wrong_ref_count():
    pool = BlockPool(4)
    pool.blocks[2].ref_cnt = 1
    with pytest.raises(AssertionError, match="free queue with ref count"):
        pool.check_invariants()
