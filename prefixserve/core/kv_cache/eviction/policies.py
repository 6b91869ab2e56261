"""Eviction policies of the block pool's free queue: the interface and the factory by name.

The free queue holds the blocks nobody references (ref count 0), cached or not; the next block it
hands out is the next one evicted. A policy is a class with the operations below; the BlockPool
(block_pool.py) allocates, frees and takes hits only through them:

  popleft_n(n)    the allocation path: remove and return `n` blocks, next evicted first;
                  ValueError naming the numbers (and nothing removed) when fewer are free
  append_n(bs)    the free path: blocks whose ref count reached 0, in the order the pool frees
                  them (a request's blocks tail first: its last block is evicted first under LRU)
  remove(b)       a cache hit (or a pin) on a free block takes it off the queue, from anywhere
  num_free_blocks an int attribute
  __iter__        the free blocks, next evicted first (checks and tests; may be O(n log n))
  holds(b)        whether `b` is in the queue, in O(1) (for the pool's invariant checks)
  check()         the policy's own structure (AssertionError naming what broke); returns the
                  free blocks, next evicted first
  reset()         called after a cache reset forgot every hash (nothing is in use then)
  name            the policy's name
  tracks_use      when True the pool keeps `block.hits` (references taken since the block was
                  cached: each cache hit and each pin) and `block.depth` (its index in the
                  request's block table when it was cached); LRU says False and pays nothing

What a policy must never do is hand out a block it was not given, or one `remove` took: the
BlockPool's check_invariants and the property tests in tests/kv_cache/test_kv_eviction.py hold
every policy to it (a block in use or pinned has a reference, so it is never in the queue).

The policies (`EVICTION_POLICIES`):
  lru    free_queue.py: least recently freed first (the default; vLLM's policy)
  slru   slru.py: segmented LRU; blocks never hit since they were cached go first, so a scan of
         one-off prompts cannot flush the prefixes that are reused
  cost   cost_aware.py: value = expected reuse x recompute cost, chain-aware (a block's value
         includes the blocks after it in the chain that was freed with it), aged GDSF-style
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prefixserve.core.kv_cache.eviction.cost_aware import CostAwareQueue
from prefixserve.core.kv_cache.eviction.lru import FreeKVCacheBlockQueue, KVCacheBlock
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
    tracks_use: bool
    num_free_blocks: int

    def popleft_n(self, n: int) -> list[KVCacheBlock]: ...

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    def remove(self, block: KVCacheBlock) -> None: ...

    def __iter__(self) -> Iterator[KVCacheBlock]: ...

    def holds(self, block: KVCacheBlock) -> bool: ...

    def check(self) -> list[KVCacheBlock]: ...

    def reset(self) -> None: ...


def check_eviction_policy(name: object) -> str:
    """`name` if it names a policy, else ValueError listing the valid names."""
    if not isinstance(name, str) or name not in _POLICIES:
        choices = ", ".join(repr(n) for n in EVICTION_POLICIES)
        raise ValueError(f"eviction_policy must be one of {choices}, got {name!r}")
    return name


def make_free_queue(name: str, blocks: Sequence[KVCacheBlock]) -> EvictionPolicy:
    """The free queue of policy `name` holding `blocks` (evicted in this order at first)."""
    return _POLICIES[check_eviction_policy(name)](blocks)
