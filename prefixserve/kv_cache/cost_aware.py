"""The cost-aware eviction policy ("cost"): evict the free block whose loss costs least.

Value of keeping a cached block = expected reuse x recompute cost, where

  expected reuse  1 + `block.hits`, the references taken since the block was cached (cache hits,
                  on free blocks or on blocks other requests hold, and pins);
  recompute cost  1 + depth / ATTENTION_DEPTH_BLOCKS: a block's linear layers cost the same at
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

A binary heap of [priority, sequence, block] entries (sequence: FIFO among equal priorities);
a hit on a free block blanks its entry in place (lazy deletion), and the heap is rebuilt without
the blanks once they outnumber the live entries: O(log n) per block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from heapq import heapify, heappop, heappush

from prefixserve.kv_cache.free_queue import KVCacheBlock

ATTENTION_DEPTH_BLOCKS = 192.0
# Blank entries tolerated before a rebuild is considered (so a small heap is not rebuilt often).
_MIN_BLANKS_TO_REBUILD = 64


class CostAwareQueue:
    """Free blocks in a heap by GDSF priority; `block.evict_key` is the block's heap entry."""

    __slots__ = ("_heap", "_seq", "inflation", "num_free_blocks", "_blanks")

    name = "cost"
    tracks_use = True

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._heap: list[list] = []
        self._seq = 0
        self.inflation = 0.0  # GDSF's L: the priority of the block evicted last
        self.num_free_blocks = 0
        self._blanks = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the `n` blocks of least priority, least first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        heap = self._heap
        out: list[KVCacheBlock] = []
        append = out.append
        entry = None
        while len(out) < n:
            entry = heappop(heap)
            block = entry[2]
            if block is None:
                self._blanks -= 1
                continue
            block.evict_key = None
            append(block)
        if entry is not None:
            self.inflation = entry[0]
        self.num_free_blocks -= n
        return out

    def popleft(self) -> KVCacheBlock:
        """Remove and return the next block to evict (ValueError when empty)."""
        return self.popleft_n(1)[0]

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Freed blocks, valued as the module docstring says (chains: tail first)."""
        heap = self._heap
        base = self.inflation
        seq = self._seq
        inv_depth = 1.0 / ATTENTION_DEPTH_BLOCKS
        chain_value = 0.0
        child_depth = -2  # depth of the block freed just before, if it was cached
        count = 0
        for block in blocks:
            if block.block_hash is None:
                chain_value = 0.0
                child_depth = -2
            else:
                depth = block.depth
                own = (1 + block.hits) * (1.0 + depth * inv_depth)
                chain_value = own + chain_value if depth == child_depth - 1 else own
                child_depth = depth
            seq += 1
            entry = [base + chain_value, seq, block]
            block.evict_key = entry
            heappush(heap, entry)
            count += 1
        self._seq = seq
        self.num_free_blocks += count

    def append(self, block: KVCacheBlock) -> None:
        """Free one block."""
        self.append_n((block,))

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` off the queue (a hit on a free block): its entry is blanked."""
        entry = block.evict_key
        if entry is None:
            raise ValueError(f"{block!r} is not in the free queue")
        entry[2] = None
        block.evict_key = None
        self.num_free_blocks -= 1
        self._blanks += 1
        if self._blanks > _MIN_BLANKS_TO_REBUILD and self._blanks > self.num_free_blocks:
            self._heap = [e for e in self._heap if e[2] is not None]
            heapify(self._heap)
            self._blanks = 0

    def _live_entries(self) -> list[list]:
        return sorted(e for e in self._heap if e[2] is not None)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, next evicted first (sorts the heap: for checks and tests)."""
        return iter([e[2] for e in self._live_entries()])

    def block_ids(self) -> list[int]:
        """Free block ids, next evicted first."""
        return [b.block_id for b in self]

    def holds(self, block: KVCacheBlock) -> bool:
        """Whether `block` has a live entry in the heap."""
        return block.evict_key is not None

    def reset(self) -> None:
        """No block is cached any more: every block is worth 0, in its current order."""
        blocks = list(self)
        self._heap = []
        self._blanks = 0
        self.num_free_blocks = 0
        self.inflation = 0.0
        self.append_n(blocks)

    def check(self) -> list[KVCacheBlock]:
        """The heap order, each live entry its block's own, the blank and live counts."""
        heap = self._heap
        for i in range(1, len(heap)):
            assert heap[(i - 1) // 2][:2] <= heap[i][:2], f"heap order broken at entry {i}"
        live = self._live_entries()
        assert len(heap) - len(live) == self._blanks, "blank heap entries miscounted"
        assert len(live) == self.num_free_blocks, (
            f"the heap holds {len(live)} blocks but counts {self.num_free_blocks}"
        )
        for entry in live:
            assert entry[2].evict_key is entry, f"{entry[2]!r} does not own its heap entry"
            assert entry[0] >= self.inflation, f"{entry[2]!r} is valued below the inflation L"
        return [e[2] for e in live]
