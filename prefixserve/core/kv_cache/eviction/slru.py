"""Segmented LRU: the frequency-aware eviction policy ("slru"), resisting scans.

Two LRU segments of free blocks, each an intrusive list (lru.py's list, one per segment):

  probation  blocks never hit since they were cached, and blocks that are not cached at all
  protected  cached blocks hit at least once since they were cached (a hit on a block in use
             counts: every reference the pool takes reaches `on_hit`); bounded to
             `protected_fraction` of the pool (80%, as in Caffeine's SLRU)

A freed block joins the tail of its segment, in the order the pool frees them; eviction takes the
head of probation, and the head of protected only once probation is empty. When protected grows
past its bound, its head (least recently freed) is demoted to the tail of probation, where one
more hit before it is evicted promotes it again when it is next freed.

Why SLRU and not S3-FIFO: both resist scans (a burst of one-off prompts only ever churns
probation, S3-FIFO's small queue), but the pool frees a request's chain tail first and a chain is
only reachable through its head, so the order inside a segment matters: SLRU keeps LRU order in
both segments, so a chain's tail still goes before its head (the pool's LRU property, kept by
construction), while S3-FIFO's main queue reinserts blocks by their frequency bits, which can
evict a chain's head and leave its tail cached and unreachable. S3-FIFO's advantage, a ghost queue
that admits a block evicted once straight into its main queue, needs a second hash set beside the
pool's map and only helps a block missed again soon after; cyclic reuse larger than the pool (the
W4 pressure workload) thrashes both. SLRU costs O(1) per block, like LRU.

Per block, beside the links, SLRU keeps two bytes of its own, indexed by block id: whether the
block was hit since it was cached (set by `on_hit`, cleared by `on_cache`) and which segment it
sits in while free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.eviction.lru import FreeKVCacheBlockQueue

PROTECTED_FRACTION = 0.8


class SegmentedLRUQueue:
    """Probation and protected LRU segments.

    `_reused[id]` is 1 for a block hit since it was cached; `_in_protected[id]` is 1 exactly
    while the block sits in protected (set when it joins, cleared when it leaves: so freeing a
    block to probation writes nothing). Both are indexed by block id, below `num_blocks` (the
    pool's size; by default one more than the largest id of `blocks`).
    """

    __slots__ = (
        "probation",
        "protected",
        "protected_capacity",
        "num_free_blocks",
        "_reused",
        "_in_protected",
    )

    name = "slru"

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        num_blocks: int | None = None,
        protected_fraction: float = PROTECTED_FRACTION,
    ) -> None:
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction!r}")
        if num_blocks is None:
            num_blocks = 1 + max((block.block_id for block in blocks), default=0)
        self._reused = bytearray(num_blocks)
        self._in_protected = bytearray(num_blocks)
        self.probation = FreeKVCacheBlockQueue(())
        self.protected = FreeKVCacheBlockQueue(())
        self.protected_capacity = int(len(blocks) * protected_fraction)
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return `n` blocks: probation's head first, then protected's."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        probation = self.probation
        num_probation = probation.num_free_blocks
        if n <= num_probation:
            out = probation.popleft_n(n)
        else:
            out = probation.popleft_n(num_probation)
            taken = self.protected.popleft_n(n - num_probation)
            in_protected = self._in_protected
            for block in taken:
                in_protected[block.block_id] = 0
            out += taken
        self.num_free_blocks -= n
        return out

    def popleft(self) -> KVCacheBlock:
        """Remove and return the next block to evict (ValueError when empty)."""
        return self.popleft_n(1)[0]

    # The pool's hooks (policies.py).

    def on_cache(self, table: Sequence[KVCacheBlock], indices: Sequence[int]) -> None:
        """Blocks just cached start unhit."""
        reused = self._reused
        for i in indices:
            reused[table[i].block_id] = 0

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Each block was hit (the null block may be among them: marking it is harmless)."""
        reused = self._reused
        for block in blocks:
            reused[block.block_id] = 1

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Nothing: `on_cache` clears the mark when a block is cached again, and a block without
        a hash never goes to protected."""

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Freed blocks to the tail of their segment, in this order; protected stays bounded."""
        # One pass linking each block at its segment's tail (as FreeKVCacheBlockQueue.append_n).
        probation, protected = self.probation, self.protected
        reused, in_protected = self._reused, self._in_protected
        fresh_last = probation.tail.prev_free
        reused_last = protected.tail.prev_free
        num_fresh = num_reused = 0
        for block in blocks:
            block_id = block.block_id
            if reused[block_id] and block.block_hash is not None:
                in_protected[block_id] = 1
                reused_last.next_free = block
                block.prev_free = reused_last
                reused_last = block
                num_reused += 1
            else:  # its mark is 0 already: a block's mark is cleared when it leaves protected
                fresh_last.next_free = block
                block.prev_free = fresh_last
                fresh_last = block
                num_fresh += 1
        fresh_last.next_free = probation.tail
        probation.tail.prev_free = fresh_last
        reused_last.next_free = protected.tail
        protected.tail.prev_free = reused_last
        probation.num_free_blocks += num_fresh
        protected.num_free_blocks += num_reused
        self.num_free_blocks += num_fresh + num_reused
        if num_reused and protected.num_free_blocks > self.protected_capacity:
            demoted = protected.popleft_n(protected.num_free_blocks - self.protected_capacity)
            for block in demoted:
                in_protected[block.block_id] = 0
            probation.append_n(demoted)

    def append(self, block: KVCacheBlock) -> None:
        """Free one block (to the tail of its segment)."""
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of whichever segment holds it (a hit on a free block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        in_protected = self._in_protected
        if in_protected[block.block_id]:
            in_protected[block.block_id] = 0
            self.protected.num_free_blocks -= 1
        else:
            self.probation.num_free_blocks -= 1
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, next evicted first: probation, then protected."""
        yield from self.probation
        yield from self.protected

    def block_ids(self) -> list[int]:
        """Free block ids, next evicted first."""
        return [b.block_id for b in self]

    def holds(self, block: KVCacheBlock) -> bool:
        """Whether `block` is linked in a segment."""
        return block.prev_free is not None

    def is_reused(self, block: KVCacheBlock) -> bool:
        """Whether `block` was hit since it was cached (it goes to protected when freed)."""
        return bool(self._reused[block.block_id])

    def in_protected(self, block: KVCacheBlock) -> bool:
        """Whether free `block` sits in protected."""
        return bool(self._in_protected[block.block_id])

    def reset(self) -> None:
        """No block is cached any more: protected's blocks join probation's tail, in order, and
        no block counts as hit."""
        protected = self.protected
        demoted = protected.popleft_n(protected.num_free_blocks)
        in_protected = self._in_protected
        for block in demoted:
            in_protected[block.block_id] = 0
        self.probation.append_n(demoted)
        self._reused = bytearray(len(self._reused))

    def check(self) -> list[KVCacheBlock]:
        """Both segments' links, each block's segment mark, protected's bound and the count."""
        probation = self.probation.check()
        protected = self.protected.check()
        in_protected = self._in_protected
        for block in probation:
            assert not in_protected[block.block_id], f"{block!r} in probation but marked protected"
        for block in protected:
            assert in_protected[block.block_id], f"{block!r} in protected but marked probation"
        assert len(protected) <= self.protected_capacity, (
            f"protected holds {len(protected)} blocks, past its bound {self.protected_capacity}"
        )
        assert self.probation.num_free_blocks + self.protected.num_free_blocks == (
            self.num_free_blocks
        ), "the segments' counts do not add up to num_free_blocks"
        return probation + protected
