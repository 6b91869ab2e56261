"""The hash -> block map and the BlockPool that owns it, the blocks and their free queue.

KVCacheBlock is block.py's, the LRU free queue eviction/lru.py's (the queue's links live on the
blocks); the free queue is an eviction policy picked by name (eviction/policies.py: "lru", "slru",
"cost"). The pool calls the policy's hooks at the moments policies.py lists (on_cache, on_hit,
append_n when blocks are freed, on_evict) and never asks which policy it has.

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

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from prefixserve.core.kv_cache.eviction.lru import FreeKVCacheBlockQueue
from prefixserve.core.kv_cache.eviction.policies import DEFAULT_EVICTION_POLICY, make_free_queue

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.reports.recorder import BlockRecorder
    from prefixserve.core.request import Request

    ExtraKeysFn = Callable[[Request, int, int], object]

__all__ = ["BlockHashToBlockMap", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class BlockHashToBlockMap:
    """Block hash -> the cached blocks of one KV-cache group.

    Blocks are keyed by the hash they carry: the pool gives a block its hash, group and token ids,
    then inserts it; pop unmaps it and clears those three, so a block carries a hash exactly while
    it is mapped. Both take many blocks per call: the loop over a batch runs here, not one method
    call per block in the pool.

    Duplicates are not deduplicated: block tables are append-only, so a block computed twice is
    cached twice under one hash. The first inserted block is the one found; later copies wait
    behind it, oldest first, and the oldest takes its place when it is popped. `get` also guards
    against hash collisions: it returns the first inserted block whose token ids are the
    request's, and counts a collision when the hash is mapped to other token ids only.
    """

    __slots__ = ("group_id", "_first", "_later", "num_collisions", "get_one_block")

    def __init__(self, group_id: int) -> None:
        self.group_id = group_id
        self._first: dict[bytes, KVCacheBlock] = {}
        # Later copies per hash, oldest first, keyed by block id (O(1) removal and promotion).
        self._later: dict[bytes, OrderedDict[int, KVCacheBlock]] = {}
        self.num_collisions = 0
        # The first inserted block of a hash, or None; token ids unchecked. It is the dict's own
        # get: the all-hit lookup calls it once per block, and a Python method in between made
        # that lookup about a quarter slower.
        self.get_one_block: Callable[[bytes], KVCacheBlock | None] = self._first.get

    def __len__(self) -> int:
        """Hashes mapped (each to one block or more)."""
        return len(self._first)

    def get(self, block_hash: bytes, token_ids: list[int]) -> KVCacheBlock | None:
        """The first inserted block with this hash and these token ids, else None."""
        block = self._first.get(block_hash)
        if block is None or block.token_ids == token_ids:
            return block
        later = self._later.get(block_hash)
        for block in later.values() if later else ():
            if block.token_ids == token_ids:
                return block
        self.num_collisions += 1
        return None

    def insert(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Map each block under the hash it carries, behind the blocks already mapped there.

        Blocks without a hash are skipped and a block already mapped stays where it is, so a
        caller may pass a range that also holds cache hits and null blocks.
        """
        setdefault = self._first.setdefault
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None and setdefault(block_hash, block) is not block:
                later = self._later.get(block_hash)
                if later is None:
                    later = self._later[block_hash] = OrderedDict()
                later[block.block_id] = block

    def pop(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unmap each block of this group and clear its hash, group and token ids.

        Blocks of other groups and uncached blocks (group -1) are skipped.
        """
        first = self._first
        if not first:
            return  # nothing mapped (later copies only exist behind a first one)
        group_id = self.group_id
        later_copies = self._later
        for block in blocks:
            if block.group_id != group_id:
                continue
            block_hash = block.block_hash
            if first.get(block_hash) is block:
                later = later_copies.get(block_hash)
                if later is None:
                    del first[block_hash]
                else:
                    first[block_hash] = later.popitem(last=False)[1]
                    if not later:
                        del later_copies[block_hash]
            else:
                later = later_copies[block_hash]
                del later[block.block_id]
                if not later:
                    del later_copies[block_hash]
            block.block_hash = block.token_ids = None
            block.group_id = -1

    def clear(self) -> None:
        """Pop every block (the collision count is cumulative and stays)."""
        for _, blocks in self.items():
            for block in blocks:
                block.block_hash = block.token_ids = None
                block.group_id = -1
        self._first.clear()  # in place: get_one_block is bound to this dict
        self._later.clear()

    def items(self) -> Iterator[tuple[bytes, list[KVCacheBlock]]]:
        """Each mapped hash with its blocks, first inserted first."""
        later = self._later
        for block_hash, block in self._first.items():
            copies = later.get(block_hash)
            yield block_hash, [block, *copies.values()] if copies else [block]


class BlockPool:
    """All KV blocks, the free queue and one hash -> block map per KV-cache group.

    Block 0 is the null block: a placeholder in block tables (sliding-window groups put it where
    they released a block); it is never allocated, freed, cached or touched. `eviction_policy`
    names the free queue's policy (eviction/policies.py; ValueError listing the names for
    another).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        num_groups: int = 1,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        recorder: BlockRecorder | None = None,
    ) -> None:
        """`recorder`: what the cache reports and the summary read (reports/recorder.py), told
        of each cache, hit and eviction; None: nobody records."""
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
        self.free_block_queue = make_free_queue(eviction_policy, self.blocks[1:], num_blocks)
        self.eviction_policy = eviction_policy
        # Indexed by group id.
        self.cached_block_hash_to_block = [BlockHashToBlockMap(g) for g in range(num_groups)]
        self.events: list[KVCacheEvent] = []
        self.recorder = recorder

    # ------------------------------------------------------------------ sizes

    @property
    def num_kv_blocks(self) -> int:
        """Allocatable blocks, the engine's `num_kv_blocks` (`num_blocks` counts the null block)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (ref count > 0)."""
        total = self.num_blocks - 1
        return (total - self.free_block_queue.num_free_blocks) / total

    @property
    def num_hash_collisions(self) -> int:
        """Lookups that met a cached hash with other token ids only (cumulative)."""
        return sum(m.num_collisions for m in self.cached_block_hash_to_block)

    # ------------------------------------------------------------------ lookup

    def get_cached_block(
        self, block_hash: bytes, group_id: int, token_ids: list[int]
    ) -> KVCacheBlock | None:
        """The first-inserted cached block of `group_id` with this hash AND these token ids.

        A block carrying the hash but other token ids is a collision: it is a miss and counts in
        `num_hash_collisions`.
        """
        return self.cached_block_hash_to_block[group_id].get(block_hash, token_ids)

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

        Blocks that already carry a hash (cache hits) and null blocks are skipped; the newly
        cached ones reach the policy's `on_cache`. With events enabled, one BlockStored is
        recorded per contiguous run of newly cached blocks (each block's parent is the one
        before it); `extra_keys_fn(request, start, end)` supplies their per-block extra keys.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        tokens = request.all_token_ids
        stored: list[int] = []  # table indices of the blocks cached now
        store = stored.append
        start = num_cached_blocks * block_size
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            end = start + block_size
            if block.block_hash is None and not block.is_null:
                block.block_hash = hashes[i]
                block.group_id = group_id
                block.token_ids = tokens[start:end]
                store(i)
            start = end  # hits and null blocks in the range are left as they are
        self.cached_block_hash_to_block[group_id].insert(blocks[num_cached_blocks:num_full_blocks])
        if not stored:
            return
        self.free_block_queue.on_cache(blocks, stored)
        if self.recorder is not None:
            self.recorder.on_cache(request, blocks, stored)
        if not self.enable_kv_cache_events:
            return
        # One event per contiguous run: each block's parent is the one before it in its event.
        cuts = [k for k in range(1, len(stored)) if stored[k] != stored[k - 1] + 1]
        for a, b in zip([0, *cuts], [*cuts, len(stored)], strict=True):
            run = stored[a:b]
            first = run[0]
            self.events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=[t for i in run for t in blocks[i].token_ids],
                    block_size=block_size,
                    lora_name=request.lora_name,
                    extra_keys=[
                        None
                        if extra_keys_fn is None
                        else extra_keys_fn(request, i * block_size, (i + 1) * block_size)
                        for i in run
                    ],
                    group_idx=group_id,
                )
            )

    def _evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Unmap the cached blocks among `blocks` and clear their hashes; others are skipped.
        The policy's `on_evict` sees them first, hashes still set."""
        self.free_block_queue.on_evict(blocks)
        if self.enable_kv_cache_events:
            self.events += [
                BlockRemoved(block_hashes=[block.block_hash], group_idx=block.group_id)
                for block in blocks
                if block.block_hash is not None
            ]
        for hash_to_block in self.cached_block_hash_to_block:
            hash_to_block.pop(blocks)

    def uncache_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Forget the hashes of these blocks (held or free) so no lookup can hit them.

        For blocks cached before their K/V was written, when the step that was to write it
        failed. Ref counts and the free queue are untouched; uncached blocks are skipped.
        """
        self._evict(blocks)

    # ------------------------------------------------------------------ ref counting

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each with ref count 1.

        A popped block that is still cached is evicted now. Asking for more blocks than are
        free raises ValueError (never a partial result).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            block.ref_cnt = 1
        if self.recorder is not None:
            self.recorder.on_evict(blocks)
        self._evict(blocks)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on each block (a cache hit or a pin); a free block leaves the free
        queue. Then the policy's `on_hit` sees them all (null blocks included)."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        queue.on_hit(blocks)
        if self.recorder is not None:
            self.recorder.on_hit(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 join the queue tail in this order.

        Freeing never evicts: a cached block keeps its hash and can be hit until it is popped.
        Callers pass a request's blocks tail first, so its last block is evicted first. The
        policy's `append_n` is its free hook.
        """
        freed: list[KVCacheBlock] = []
        append = freed.append
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)
        self.free_block_queue.append_n(freed)

    # ------------------------------------------------------------------ reset & events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        if self.recorder is not None:
            self.recorder.on_reset(
                [
                    h
                    for hash_to_block in self.cached_block_hash_to_block
                    for h, _ in hash_to_block.items()
                ]
            )
        for hash_to_block in self.cached_block_hash_to_block:
            hash_to_block.clear()
        self.free_block_queue.reset()
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
        queue = self.free_block_queue
        assert not queue.holds(null), "null block in the free queue"
        seen: set[int] = set()
        for block in queue.check():  # the policy's own structure first
            assert block.block_id not in seen, f"{block!r} twice in the free queue"
            assert block.ref_cnt == 0, f"{block!r} is in the free queue with ref count > 0"
            assert queue.holds(block), f"{block!r} is listed but not held by the free queue"
            seen.add(block.block_id)
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
                assert not queue.holds(block), f"{block!r} is in use but linked in the free queue"
        assert in_use + len(seen) == self.num_blocks - 1, (
            f"free ({len(seen)}) + in use ({in_use}) != total ({self.num_blocks - 1})"
        )
        mapped: set[int] = set()
        for group_id, hash_to_block in enumerate(self.cached_block_hash_to_block):
            for block_hash, blocks in hash_to_block.items():
                for block in blocks:
                    assert block.block_hash == block_hash, (
                        f"map entry {block_hash.hex()} -> {block!r}"
                    )
                    assert block.group_id == group_id, f"{block!r} mapped in group {group_id}"
                    assert block.block_id not in mapped, f"{block!r} mapped twice"
                    assert block.token_ids is not None, f"cached {block!r} forgot its token ids"
                    mapped.add(block.block_id)
        for block in self.blocks:
            if block.block_hash is not None:
                assert block.block_id in mapped, f"{block!r} carries a hash but is not mapped"
