"""KVCacheBlock, the free queue, the hash -> block map and the BlockPool that owns them.

Vocabulary:
  free     a block nobody references (ref count 0). It sits in the free queue and, when it was
           cached, still carries its hash: it can be hit again.
  evict    a free block popped for new content: its hash and map entry are dropped at that moment.
  cached   a block whose hash is in the map (it may be free or in use).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prefixserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from prefixserve.request import Request

    ExtraKeysFn = Callable[[Request, int, int], object]


class KVCacheBlock:
    """One physical KV block. Created once by the pool; never copied."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "token_ids",
        "prev_free",
        "next_free",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while cached: the block's hash, its KV-cache group and its token ids (kept to
        # detect hash collisions).
        self.block_hash: bytes | None = None
        self.group_id = -1
        self.token_ids: list[int] | None = None
        # Free-queue links; None when the block is not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks; the head is the next block to evict (LRU).

    popleft, append and remove are O(1) and allocate nothing: the links live on the blocks.
    """

    __slots__ = ("head", "tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)  # sentinels: never in a block table
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = len(blocks)
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (ValueError when empty)."""
        block = self.head.next_free
        if block is self.tail or block is None:
            raise ValueError("no free block to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, head first (ValueError when fewer are free)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        out = []
        append = out.append
        block = self.head.next_free
        for _ in range(n):
            append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self.head.next_free = block
        block.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        tail = self.tail
        last = tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, head (next evicted) first."""
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids, head (next evicted) first."""
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks, the free queue (LRU) and the map from (group, hash) to cached blocks.

    Block 0 is the null block: a placeholder in block tables (sliding-window groups put it where
    they released a block); it is never allocated, freed, cached or touched.

    Duplicates are not deduplicated: block tables are append-only, so a block computed twice is
    cached twice. The map keeps the first inserted block in `cached[group][hash]` and later
    ones in `duplicates[group][hash]`; a lookup returns the first inserted block whose stored
    token ids equal the request's.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        num_groups: int = 1,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached: list[dict[bytes, KVCacheBlock]] = [{} for _ in range(num_groups)]
        # Later copies per hash, oldest first, keyed by block id (O(1) removal and promotion).
        self.duplicates: list[dict[bytes, OrderedDict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        self.num_hash_collisions = 0
        self.events: list[KVCacheEvent] = []

    # ------------------------------------------------------------------ sizes

    @property
    def num_total_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (ref count > 0)."""
        total = self.num_blocks - 1
        return (total - self.free_block_queue.num_free_blocks) / total

    # ------------------------------------------------------------------ lookup

    def get_cached_block(
        self, block_hash: bytes, group_id: int, token_ids: list[int]
    ) -> KVCacheBlock | None:
        """The first-inserted cached block of `group_id` with this hash AND these token ids.

        A block carrying the hash but other token ids is a collision: it is a miss and counts in
        `num_hash_collisions`.
        """
        block = self.cached[group_id].get(block_hash)
        if block is None:
            return None
        if block.token_ids == token_ids:
            return block
        return self._lookup_past_collision(block_hash, group_id, token_ids)

    def _lookup_past_collision(
        self, block_hash: bytes, group_id: int, token_ids: list[int]
    ) -> KVCacheBlock | None:
        """The first later copy with these token ids; counts a collision when there is none."""
        later = self.duplicates[group_id].get(block_hash)
        for block in later.values() if later else ():
            if block.token_ids == token_ids:
                return block
        self.num_hash_collisions += 1
        return None

    # ------------------------------------------------------------------ caching

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int = 0,
        extra_keys_fn: ExtraKeysFn | None = None,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] the request's hashes and map them.

        Blocks that already carry a hash (cache hits) and null blocks are skipped. With events
        enabled, one BlockStored is recorded; `extra_keys_fn(request, start, end)` supplies its
        per-block extra keys.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        tokens = request.all_token_ids
        cached = self.cached[group_id]
        events = self.enable_kv_cache_events
        stored: list[int] = []
        start = num_cached_blocks * block_size
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            end = start + block_size
            if block.block_hash is None and not block.is_null:
                block_hash = hashes[i]
                block.block_hash = block_hash
                block.group_id = group_id
                block.token_ids = tokens[start:end]
                if cached.setdefault(block_hash, block) is not block:
                    later = self.duplicates[group_id].get(block_hash)
                    if later is None:
                        later = self.duplicates[group_id][block_hash] = OrderedDict()
                    later[block.block_id] = block
                if events:
                    stored.append(i)
            start = end
        if stored:
            first = stored[0]
            self.events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in stored],
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=[t for i in stored for t in blocks[i].token_ids],
                    block_size=block_size,
                    lora_name=request.lora_name,
                    extra_keys=[
                        None
                        if extra_keys_fn is None
                        else extra_keys_fn(request, i * block_size, (i + 1) * block_size)
                        for i in stored
                    ],
                    group_idx=group_id,
                )
            )

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a cached block's hash and map entry (it is about to get new content)."""
        block_hash = block.block_hash
        group_id = block.group_id
        cached = self.cached[group_id]
        duplicates = self.duplicates[group_id]
        if cached.get(block_hash) is block:
            later = duplicates.get(block_hash)
            if later:
                cached[block_hash] = later.popitem(last=False)[1]
                if not later:
                    del duplicates[block_hash]
            else:
                del cached[block_hash]
        else:
            later = duplicates[block_hash]
            del later[block.block_id]
            if not later:
                del duplicates[block_hash]
        block.block_hash = None
        block.token_ids = None
        block.group_id = -1
        if self.enable_kv_cache_events:
            self.events.append(BlockRemoved(block_hashes=[block_hash], group_idx=group_id))

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of these blocks (held or free) so no lookup can hit them.

        For blocks cached before their K/V was written, when the step that was to write it
        failed. Ref counts and the free queue are untouched; uncached blocks are skipped.
        """
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    # ------------------------------------------------------------------ ref counting

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each with ref count 1.

        A popped block that is still cached is evicted now. Asking for more blocks than are
        free raises ValueError (never a partial result).
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {queue.num_free_blocks} are free"
            )
        # popleft_n with the eviction folded in: one pass, no per-block method calls.
        head = queue.head
        block = head.next_free
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        cached_maps = self.cached
        duplicate_maps = self.duplicates
        events = self.events if self.enable_kv_cache_events else None
        for _ in range(num_blocks):
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block_hash = block.block_hash
            if block_hash is not None:
                group_id = block.group_id
                cached = cached_maps[group_id]
                if cached.get(block_hash) is block and block_hash not in duplicate_maps[group_id]:
                    # The common eviction: the only cached copy of this hash.
                    del cached[block_hash]
                    block.block_hash = block.token_ids = None
                    block.group_id = -1
                    if events is not None:
                        events.append(BlockRemoved(block_hashes=[block_hash], group_idx=group_id))
                else:
                    self._evict(block)
            block.ref_cnt = 1
            append(block)
            block = nxt
        head.next_free = block
        block.prev_free = head
        queue.num_free_blocks -= num_blocks
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a cache hit); a free block leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 join the queue tail in this order.

        Freeing never evicts: a cached block keeps its hash and can be hit until it is popped.
        Callers pass a request's blocks tail first, so its last block is evicted first.
        """
        queue = self.free_block_queue
        tail = queue.tail
        freed = 0
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                last = tail.prev_free
                last.next_free = block
                block.prev_free = last
                block.next_free = tail
                tail.prev_free = block
                freed += 1
        queue.num_free_blocks += freed

    # ------------------------------------------------------------------ reset & events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for cached in self.cached:
            cached.clear()
        for duplicates in self.duplicates:
            duplicates.clear()
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
            block.group_id = -1
        if self.enable_kv_cache_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call and forget them."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken pool invariant."""
        null = self.null_block
        assert null.is_null and null.block_id == 0, "block 0 must be the null block"
        assert null.block_hash is None, "the null block must never be cached"
        assert null.prev_free is None and null.next_free is None, "null block in the free queue"
        queue = self.free_block_queue
        seen: set[int] = set()
        prev = queue.head
        block = prev.next_free
        while block is not queue.tail:
            assert block is not None, "free queue is broken (dangling link)"
            assert block.prev_free is prev, f"free queue back link broken at {block!r}"
            assert block.block_id not in seen, f"{block!r} twice in the free queue"
            assert block.ref_cnt == 0, f"{block!r} is in the free queue with ref count > 0"
            seen.add(block.block_id)
            prev, block = block, block.next_free
        assert queue.tail.prev_free is prev, "free queue tail link broken"
        assert len(seen) == queue.num_free_blocks, (
            f"free queue holds {len(seen)} blocks but counts {queue.num_free_blocks}"
        )
        in_use = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block!r} has a negative ref count"
            if block.ref_cnt == 0:
                assert block.block_id in seen, f"{block!r} has ref count 0 but is not free"
            else:
                in_use += 1
                assert block.prev_free is None and block.next_free is None, (
                    f"{block!r} is in use but linked in the free queue"
                )
        assert in_use + len(seen) == self.num_blocks - 1, (
            f"free ({len(seen)}) + in use ({in_use}) != total ({self.num_blocks - 1})"
        )
        mapped: set[int] = set()
        for group_id, (cached, duplicates) in enumerate(
            zip(self.cached, self.duplicates, strict=True)
        ):
            entries = [(h, b) for h, b in cached.items()]
            entries += [(h, b) for h, later in duplicates.items() for b in later.values()]
            for block_hash, block in entries:
                assert block.block_hash == block_hash, f"map entry {block_hash.hex()} -> {block!r}"
                assert block.group_id == group_id, f"{block!r} mapped in group {group_id}"
                assert block.block_id not in mapped, f"{block!r} mapped twice"
                assert block.token_ids is not None, f"cached {block!r} forgot its token ids"
                mapped.add(block.block_id)
            for block_hash in duplicates:
                assert block_hash in cached, "a duplicate entry without a first entry"
        for block in self.blocks:
            if block.block_hash is not None:
                assert block.block_id in mapped, f"{block!r} carries a hash but is not mapped"
