"""The LRU free queue: the blocks nobody references, in eviction order.

The queue is intrusive: its links live in the blocks' own slots (`prev_free`, `next_free` of
`kv_cache/block.py` `KVCacheBlock`). The BlockPool (block_pool.py) owns one queue and goes
through these methods and hooks only; `policies.py` names what every eviction policy has and
picks a policy by name. LRU is the default; `slru.py` and `cost_aware.py` are the others (SLRU
reuses this class per segment). LRU keeps no state beyond the links: its hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefixserve.core.kv_cache.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks; the head is the next block to evict (LRU).

    Every operation is O(1) per block: the links live on the blocks. popleft_n and append_n are
    the pool's allocation and free paths; popleft and append are their one-block forms.
    """

    __slots__ = ("head", "tail", "num_free_blocks")

    name = "lru"

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int | None = None) -> None:
        """`num_blocks` is the pool's size (the policy protocol's; LRU keeps nothing per id)."""
        self.head = KVCacheBlock(-1)  # sentinels: never in a block table
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, head first (ValueError when fewer are free)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        head = self.head
        out = [head] * n  # every slot is overwritten: cheaper than n appends
        block = head.next_free
        for i in range(n):
            out[i] = block
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        block.prev_free = head
        self.num_free_blocks -= n
        return out

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (ValueError when empty)."""
        return self.popleft_n(1)[0]

    # The pool's hooks (policies.py): LRU orders blocks by freeing alone and ignores them.

    def on_cache(self, table: Sequence[KVCacheBlock], indices: Sequence[int]) -> None:
        """Blocks just cached: nothing to do."""

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """References taken: nothing to do (a free one was already `remove`d)."""

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Hashes about to be dropped: nothing to do."""

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put `blocks` at the tail in this order (the last one is evicted last)."""
        tail = self.tail
        last = tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, head (next evicted) first."""
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids, head (next evicted) first."""
        return [b.block_id for b in self]

    def holds(self, block: KVCacheBlock) -> bool:
        """Whether `block` is linked in a queue (this one, or another sharing the link slots)."""
        return block.prev_free is not None

    def reset(self) -> None:
        """Every hash was forgotten: LRU keeps its order (nothing depends on the hashes)."""

    def check(self) -> list[KVCacheBlock]:
        """Walk the links (AssertionError naming a broken one); the free blocks, head first."""
        out: list[KVCacheBlock] = []
        prev = self.head
        block = prev.next_free
        while block is not self.tail:
            assert block is not None, "free queue is broken (dangling link)"
            assert block.prev_free is prev, f"free queue back link broken at {block!r}"
            assert len(out) <= self.num_free_blocks, "free queue holds more than it counts"
            out.append(block)
            prev, block = block, block.next_free
        assert self.tail.prev_free is prev, "free queue tail link broken"
        return out
