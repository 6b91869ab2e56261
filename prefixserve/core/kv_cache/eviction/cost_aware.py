"""The cost-aware eviction policy ("cost"): evict the free block whose loss costs least.

Value of keeping a cached block = expected reuse x recompute cost, where

  expected reuse  1 + hits, the references taken since the block was cached (cache hits, on
                  free blocks or on blocks other requests hold, and pins: `on_hit` counts them,
                  `on_cache` starts them at 0);
  recompute cost  1 + depth / ATTENTION_DEPTH_BLOCKS, depth the block's index in the table of
                  the request that cached it (`on_cache`): a block's linear layers cost the same at
                  any position, its attention grows with the position. For the default model
                  (SmolLM2-135M: 30 layers, width 576, ~106M weights outside the embeddings) one
                  token's attention costs 4*30*576*T FLOPs at position T against 2*106M for its
                  GEMMs: equal at T ~ 3,072 tokens, 192 blocks of 16;
  chain           a prompt's blocks are reachable only through the blocks before them, so evicting
                  a block loses the blocks after it too. The pool frees a request's blocks tail
                  first; a block freed right after its child (depth one less, in the same call)
                  adds the child's value to its own. Within a chain, value then rises from the
                  tail to the head: the tail goes first, and a long reused prefix is worth the
                  whole of it. A block that is not cached is worth 0 and goes first of all.

Ageing is GDSF's (Greedy-Dual-Size-Frequency, Cherkasova 1998): a freed block's priority is
L + value, the block of least priority is evicted first, and L becomes the priority of the block
last evicted. A block hit often long ago therefore does not stay forever: every eviction raises
L, and blocks freed later start from the higher L.

A binary heap of int keys, priority (in 1/256ths) above a sequence number (FIFO among equal
priorities), with a dict key -> block beside it: ints compare in C (alloc+free ran 2-3x slower
with [priority, sequence, block] list entries). A hit on a free block drops its dict entry and
leaves the key in the heap (lazy deletion); the heap is rebuilt without the dead keys once they
outnumber the live ones. O(log n) per block. The policy's per-block state, hits, depth and heap
key, is kept in lists of its own indexed by block id.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from heapq import heapify, heappop, heappush

from prefixserve.core.kv_cache.block import KVCacheBlock

ATTENTION_DEPTH_BLOCKS = 192.0
PRIORITY_SCALE = 256  # priorities are kept in 1/256ths of one block's value
_SEQ_BITS = 40  # a key is priority << _SEQ_BITS | sequence number
# Dead keys tolerated before a rebuild is considered (so a small heap is not rebuilt often).
_MIN_DEAD_TO_REBUILD = 64


class CostAwareQueue:
    """Free blocks in a heap by GDSF priority.

    Indexed by block id, below `num_blocks` (the pool's size; by default one more than the
    largest id of `blocks`): `_hits` and `_depth` (set when the block was cached, counted on each
    hit) and `_key`, a free block's heap key (None while it is not free).
    """

    __slots__ = ("_heap", "_blocks", "_seq", "_base", "num_free_blocks", "_hits", "_depth", "_key")

    name = "cost"

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int | None = None) -> None:
        if num_blocks is None:
            num_blocks = 1 + max((block.block_id for block in blocks), default=0)
        self._hits = [0] * num_blocks
        self._depth = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._heap: list[int] = []
        self._blocks: dict[int, KVCacheBlock] = {}  # live key -> block
        self._seq = 0
        self._base = 0  # GDSF's L in 1/256ths: the priority of the block evicted last
        self.num_free_blocks = 0
        self.append_n(blocks)

    @property
    def inflation(self) -> float:
        """GDSF's L: the priority of the block evicted last."""
        return self._base / PRIORITY_SCALE

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the `n` blocks of least priority, least first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        heap = self._heap
        take = self._blocks.pop
        keys = self._key
        out: list[KVCacheBlock] = []
        append = out.append
        key = -1
        while len(out) < n:
            key = heappop(heap)
            block = take(key, None)
            if block is not None:
                keys[block.block_id] = None
                append(block)
        if key >= 0:
            self._base = key >> _SEQ_BITS
        self.num_free_blocks -= n
        return out

    def popleft(self) -> KVCacheBlock:
        """Remove and return the next block to evict (ValueError when empty)."""
        return self.popleft_n(1)[0]

    # The pool's hooks (policies.py).

    def on_cache(self, table: Sequence[KVCacheBlock], indices: Sequence[int]) -> None:
        """Blocks just cached: no hits yet, their depth is their index in the table."""
        hits, depths = self._hits, self._depth
        for i in indices:
            block_id = table[i].block_id
            hits[block_id] = 0
            depths[block_id] = i

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """One more reference on each block (counting the null block's is harmless)."""
        hits = self._hits
        for block in blocks:
            hits[block.block_id] += 1

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Nothing: a block without a hash is worth 0, and `on_cache` restarts its counts."""

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Freed blocks, valued as the module docstring says (chains: tail first)."""
        heap = self._heap
        live = self._blocks
        hits, depths, keys = self._hits, self._depth, self._key
        base = self._base
        seq = self._seq
        scale = float(PRIORITY_SCALE)
        depth_scale = scale / ATTENTION_DEPTH_BLOCKS
        chain_value = 0  # in 1/256ths
        child_depth = -2  # depth of the block freed just before, if it was cached
        count = 0
        for block in blocks:
            block_id = block.block_id
            if block.block_hash is None:
                chain_value = 0
                child_depth = -2
            else:
                depth = depths[block_id]
                own = int((1 + hits[block_id]) * (scale + depth * depth_scale))
                chain_value = own + chain_value if depth == child_depth - 1 else own
                child_depth = depth
            seq += 1
            key = (base + chain_value) << _SEQ_BITS | seq
            keys[block_id] = key
            live[key] = block
            heappush(heap, key)
            count += 1
        self._seq = seq
        self.num_free_blocks += count

    def append(self, block: KVCacheBlock) -> None:
        """Free one block."""
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` off the queue (a hit on a free block); its key stays in the heap, dead."""
        key = self._key[block.block_id]
        if key is None:
            raise ValueError(f"{block!r} is not in the free queue")
        del self._blocks[key]
        self._key[block.block_id] = None
        self.num_free_blocks -= 1
        num_dead = len(self._heap) - self.num_free_blocks
        if num_dead > _MIN_DEAD_TO_REBUILD and num_dead > self.num_free_blocks:
            self._heap = list(self._blocks)
            heapify(self._heap)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, next evicted first (sorts the live keys: for checks and tests)."""
        live = self._blocks
        return iter([live[key] for key in sorted(live)])

    def block_ids(self) -> list[int]:
        """Free block ids, next evicted first."""
        return [b.block_id for b in self]

    def holds(self, block: KVCacheBlock) -> bool:
        """Whether `block` has a live key in the heap."""
        return self._key[block.block_id] is not None

    def priority(self, block: KVCacheBlock) -> float:
        """The priority of a free block (GDSF's L at its freeing + its value)."""
        return (self._key[block.block_id] >> _SEQ_BITS) / PRIORITY_SCALE

    def hits(self, block: KVCacheBlock) -> int:
        """References taken on `block` since it was cached."""
        return self._hits[block.block_id]

    def depth(self, block: KVCacheBlock) -> int:
        """`block`'s index in the table of the request that cached it."""
        return self._depth[block.block_id]

    def reset(self) -> None:
        """No block is cached any more: every block is worth 0, in its current order."""
        blocks = list(self)
        self._heap = []
        self._blocks = {}
        self._base = 0
        self.num_free_blocks = 0
        self.append_n(blocks)

    def check(self) -> list[KVCacheBlock]:
        """The heap order, each live key its block's own, the live count, L below every key."""
        heap = self._heap
        for i in range(1, len(heap)):
            assert heap[(i - 1) // 2] <= heap[i], f"heap order broken at entry {i}"
        live = self._blocks
        assert len(live) == self.num_free_blocks, (
            f"the heap holds {len(live)} blocks but counts {self.num_free_blocks}"
        )
        keys = set(heap)
        for key, block in live.items():
            assert key in keys, f"{block!r}'s key is not in the heap"
            assert self._key[block.block_id] == key, f"{block!r} does not own its heap key"
            assert key >> _SEQ_BITS >= self._base, f"{block!r} is valued below the inflation L"
        return list(self)
