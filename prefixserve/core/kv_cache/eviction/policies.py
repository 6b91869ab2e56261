"""Eviction policies of the block pool's free queue: the interface and the factory by name.

The free queue holds the blocks nobody references (ref count 0), cached or not; the next block it
hands out is the next one evicted. A policy is a class built as `Policy(blocks, num_blocks)`
(the pool's free blocks, in their first eviction order, and the pool's size: every block id is
below it) with the operations and hooks below. The BlockPool (block_pool.py) allocates, frees,
takes hits and evicts only through them, and never asks which policy it has.

Queue operations:
  popleft_n(n)    the allocation path: remove and return `n` blocks, next evicted first;
                  ValueError naming the numbers (and nothing removed) when fewer are free
  append_n(bs)    the free path (the "on free" hook): blocks whose ref count reached 0, in the
                  order the pool frees them (a request's blocks tail first: its last block is
                  evicted first under LRU); cached ones still carry their hash
  remove(b)       a cache hit (or a pin) on a free block takes it off the queue, from anywhere
  num_free_blocks an int attribute
  __iter__        the free blocks, next evicted first (checks and tests; may be O(n log n))
  holds(b)        whether `b` is in the queue, in O(1) (for the pool's invariant checks)
  check()         the policy's own structure (AssertionError naming what broke); returns the
                  free blocks, next evicted first
  reset()         called after a cache reset forgot every hash (nothing is in use then): drop
                  what the policy knows of cached blocks
  name            the policy's name

Hooks, each called once per batch of blocks (one call per pool operation: a method call per
block would cost LRU, whose hooks do nothing, on the hot path):
  on_cache(table, indices)
                  cache_full_blocks gave `table[i]` its hash, for each i in `indices` (ascending;
                  `table` is the request's block table, so i is the block's depth in the prompt's
                  chain, 0 for its first block). Called after the hashes are set and mapped. The
                  blocks are in use (ref count >= 1), not in the queue. A policy starts the
                  block's usage state here (no hits yet, its depth). Blocks in the table that
                  were already cached (hits) are not among them.
  on_hit(blocks)  touch took one more reference on each block: a cache hit by a request or a
                  pin, on a free block (already taken off the queue by `remove` and at ref
                  count 1 now) or on one in use. The null block may be among them (it is never
                  freed: counting it is harmless, or skip `block.is_null`). A policy counts use
                  here; it must not touch the queue.
  on_evict(blocks)
                  the pool is about to drop the hashes of the cached blocks among `blocks` (it
                  may pass uncached ones too: check `block.block_hash`): blocks `popleft_n` just
                  handed out for new content, or blocks uncached because their K/V was never
                  written (those may be free or in use; the queue keeps them where they are).
                  Called before the hashes are cleared, so a policy can still read them; it may
                  drop what it keeps per cached block, and must not touch the queue. Not called
                  by a cache reset: `reset()` is.

Per-block state a policy needs (hit counts, depths, a segment mark, a heap key) is the policy's
own: lists or bytearrays indexed by `block.block_id`, sized by `num_blocks`. KVCacheBlock
carries only the pool's fields and the LRU links (`prev_free` / `next_free`, which SLRU reuses
for its segments). A block table's blocks are evicted in the order the policy hands them out,
so a policy must keep a chain's head cached at least as long as its tail (the pool frees a
chain tail first; every policy here keeps that order).

What a policy must never do is hand out a block it was not given, or one `remove` took: the
BlockPool's check_invariants and the property tests in tests/kv_cache/test_kv_eviction.py hold
every policy to it (a block in use or pinned has a reference, so it is never in the queue).

The policies (`EVICTION_POLICIES`):
  lru    lru.py: least recently freed first (the default; vLLM's policy); its hooks do nothing
  slru   slru.py: segmented LRU; blocks never hit since they were cached go first, so a scan of
         one-off prompts cannot flush the prefixes that are reused (on_cache / on_hit keep a
         "hit since cached" mark per block)
  cost   cost_aware.py: value = expected reuse x recompute cost, chain-aware (a block's value
         includes the blocks after it in the chain that was freed with it), aged GDSF-style
         (on_cache records the depth, on_hit counts the hits)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.eviction.cost_aware import CostAwareQueue
from prefixserve.core.kv_cache.eviction.lru import FreeKVCacheBlockQueue
from prefixserve.core.kv_cache.eviction.slru import SegmentedLRUQueue

DEFAULT_EVICTION_POLICY = "lru"

_POLICIES: dict[str, type] = {
    "lru": FreeKVCacheBlockQueue,
    "slru": SegmentedLRUQueue,
    "cost": CostAwareQueue,
}
EVICTION_POLICIES: tuple[str, ...] = tuple(_POLICIES)


class EvictionPolicy(Protocol):
    """What the BlockPool needs of a free queue (see the module docstring)."""

    name: str
    num_free_blocks: int

    def popleft_n(self, n: int) -> list[KVCacheBlock]: ...

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    def remove(self, block: KVCacheBlock) -> None: ...

    def __iter__(self) -> Iterator[KVCacheBlock]: ...

    def holds(self, block: KVCacheBlock) -> bool: ...

    def check(self) -> list[KVCacheBlock]: ...

    def reset(self) -> None: ...

    def on_cache(self, table: Sequence[KVCacheBlock], indices: Sequence[int]) -> None: ...

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None: ...


def check_eviction_policy(name: object) -> str:
    """`name` if it names a policy, else ValueError listing the valid names."""
    if not isinstance(name, str) or name not in _POLICIES:
        choices = ", ".join(repr(n) for n in EVICTION_POLICIES)
        raise ValueError(f"eviction_policy must be one of {choices}, got {name!r}")
    return name


def make_free_queue(
    name: str, blocks: Sequence[KVCacheBlock], num_blocks: int | None = None
) -> EvictionPolicy:
    """The free queue of policy `name` holding `blocks` (evicted in this order at first), for a
    pool of `num_blocks` blocks (default: one more than the largest id in `blocks`)."""
    return _POLICIES[check_eviction_policy(name)](blocks, num_blocks)
