"""When the BlockPool calls an eviction policy's hooks (core/kv_cache/eviction/policies.py).

A recording policy (LRU's queue, every operation and hook logged) is registered under a name of
its own, so the pool builds it through the factory as it builds the real ones.
"""

from __future__ import annotations

import pytest

from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.eviction import policies
from prefixserve.core.kv_cache.eviction.lru import FreeKVCacheBlockQueue
from tests.helpers.kv_cache import make_request

BS = 4


class RecordingPolicy(FreeKVCacheBlockQueue):
    """LRU's order, with each call the pool makes appended to `log`."""

    __slots__ = ("log", "num_blocks")

    name = "record"

    def __init__(self, blocks, num_blocks=None) -> None:
        self.log: list[tuple] = []
        self.num_blocks = num_blocks
        super().__init__(blocks, num_blocks)
        self.log.clear()  # the initial fill is not a free

    def popleft_n(self, n):
        out = super().popleft_n(n)
        self.log.append(("popleft", [b.block_id for b in out]))
        return out

    def append_n(self, blocks):
        blocks = list(blocks)
        self.log.append(("free", [b.block_id for b in blocks]))
        super().append_n(blocks)

    def remove(self, block):
        self.log.append(("remove", block.block_id))
        super().remove(block)

    def reset(self):
        self.log.append(("reset",))

    def on_cache(self, table, indices):
        # Called once the hashes are set, with each block's index in its table.
        assert all(table[i].block_hash is not None for i in indices)
        self.log.append(("cache", [(table[i].block_id, i) for i in indices]))

    def on_hit(self, blocks):
        # A free block hit was taken off the queue first: every block has its reference now.
        assert all(b.ref_cnt >= 1 and not self.holds(b) for b in blocks if not b.is_null)
        self.log.append(("hit", [b.block_id for b in blocks]))

    def on_evict(self, blocks):
        # The hashes are still there to read; uncached blocks may ride along.
        self.log.append(("evict", [b.block_id for b in blocks if b.block_hash is not None]))


@pytest.fixture
def pool(monkeypatch) -> BlockPool:
    monkeypatch.setitem(policies._POLICIES, "record", RecordingPolicy)
    pool = BlockPool(5, eviction_policy="record")  # blocks 1-4
    assert isinstance(pool.free_block_queue, RecordingPolicy)
    assert pool.free_block_queue.num_blocks == 5  # the pool's size, for arrays by block id
    return pool


def take_log(pool: BlockPool) -> list[tuple]:
    log = pool.free_block_queue.log
    out = list(log)
    log.clear()
    return out


def test_the_pool_calls_the_hooks_in_order_allocate_cache_free_hit_evict(pool):
    request = make_request("a", list(range(2 * BS + 1)), block_size=BS)

    blocks = pool.get_new_blocks(3)  # allocate: nothing cached yet, so nothing evicted
    assert take_log(pool) == [("popleft", [1, 2, 3]), ("evict", [])]

    pool.cache_full_blocks(request, blocks, 0, 2, BS)  # two full blocks get their hashes
    assert take_log(pool) == [("cache", [(1, 0), (2, 1)])]
    pool.cache_full_blocks(request, blocks, 0, 2, BS)  # already cached: no hook
    assert take_log(pool) == []

    pool.free_blocks(reversed(blocks))  # tail first
    assert take_log(pool) == [("free", [3, 2, 1])]

    pool.touch(blocks[:2])  # a hit on two free cached blocks: off the queue, then on_hit
    assert take_log(pool) == [("remove", 1), ("remove", 2), ("hit", [1, 2])]
    pool.touch(blocks[:1])  # a second reference on a block in use: on_hit only
    assert take_log(pool) == [("hit", [1])]
    pool.touch([pool.null_block])  # the null block may reach on_hit; it is never freed
    assert take_log(pool) == [("hit", [0])]

    pool.free_blocks([blocks[1], blocks[0], blocks[0]])
    assert take_log(pool) == [("free", [2, 1])]  # only blocks reaching ref count 0

    # Evict: the queue hands out 4 (never used), 3 (uncached), then the cached 2 and 1; the
    # hook sees those two before their hashes are dropped.
    new = pool.get_new_blocks(4)
    assert take_log(pool) == [("popleft", [4, 3, 2, 1]), ("evict", [2, 1])]
    assert all(b.block_hash is None for b in new)
    pool.check_invariants()


def test_uncaching_a_held_block_is_an_eviction_and_a_reset_is_a_reset(pool):
    request = make_request("a", list(range(BS)), block_size=BS)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, BS)
    take_log(pool)
    pool.uncache_blocks(blocks)  # its K/V was never written: forgotten, still held
    assert take_log(pool) == [("evict", [1])]
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(1)  # cached once more, then freed: a free cached block
    pool.cache_full_blocks(request, again, 0, 1, BS)
    pool.free_blocks(again)
    take_log(pool)
    assert pool.reset_prefix_cache()
    assert take_log(pool) == [("reset",)]  # no on_evict: reset() drops everything at once
