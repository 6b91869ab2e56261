"""What the pool did to each block, for reports and the operators' summary.

`BlockPool` calls the recorder when it caches blocks, hits them, evicts them and resets; the
recorder keeps, per block id, who cached it (`Namespace`), its parent hash and depth in its chain,
its hits and last use, and it feeds the eviction ghosts and the recent-window counters. Arrays
indexed by block id, sized once: nothing here grows with traffic except the bounded ghosts and
the fixed window of per-second buckets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.core.kv_cache.reports.ghost import EvictionGhosts

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.block import KVCacheBlock
    from prefixserve.core.request import Request

WINDOW_SECONDS = 300  # the longest recent window the summary reports


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who a block's chain belongs to: the tenant and the keys that set its hashes apart."""

    tenant: str | None
    cache_salt: str | None
    lora_name: str | None
    lora_digest: str | None = None

    @classmethod
    def of(cls, request: Request) -> Namespace:
        return cls(request.tenant, request.cache_salt, request.lora_name, request.lora_digest)


class RecentWindow:
    """Counts per second over the last WINDOW_SECONDS seconds: prompt tokens queried, tokens hit
    (RAM or disk), blocks evicted."""

    __slots__ = ("_clock", "_seconds", "_counts")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._seconds = [-1] * WINDOW_SECONDS
        self._counts = [[0, 0, 0] for _ in range(WINDOW_SECONDS)]

    def add(self, queries: int = 0, hits: int = 0, evictions: int = 0) -> None:
        second = int(self._clock())
        slot = second % WINDOW_SECONDS
        counts = self._counts[slot]
        if self._seconds[slot] != second:
            self._seconds[slot] = second
            counts[0] = counts[1] = counts[2] = 0
        counts[0] += queries
        counts[1] += hits
        counts[2] += evictions

    def totals(self, seconds: int) -> tuple[int, int, int]:
        """(queries, hits, evictions) over the last `seconds` seconds (at most WINDOW_SECONDS)."""
        now = int(self._clock())
        first = now - min(seconds, WINDOW_SECONDS) + 1
        queries = hits = evictions = 0
        for second, counts in zip(self._seconds, self._counts, strict=True):
            if first <= second <= now:
                queries += counts[0]
                hits += counts[1]
                evictions += counts[2]
        return queries, hits, evictions


class BlockRecorder:
    """Per-block history of one pool (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        policy: str,
        ghost_entries: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.ghosts = EvictionGhosts(ghost_entries)
        self.window = RecentWindow(clock)
        self.namespace: list[Namespace | None] = [None] * num_blocks
        self.parent: list[bytes | None] = [None] * num_blocks
        self.depth = [0] * num_blocks
        self.hits = [0] * num_blocks
        self.last_use = [0.0] * num_blocks
        self.num_evicted = 0

    def on_cache(self, request: Request, blocks: Sequence[KVCacheBlock], stored: list[int]) -> None:
        """`blocks[i]` for i in `stored` were just cached as block i of `request`'s chain."""
        namespace = Namespace.of(request)
        hashes = request.block_hashes
        now = self.clock()
        for i in stored:
            block_id = blocks[i].block_id
            self.namespace[block_id] = namespace
            self.parent[block_id] = hashes[i - 1] if i else None
            self.depth[block_id] = i
            self.hits[block_id] = 0
            self.last_use[block_id] = now

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """These cached blocks were hit (touched by a request or a pin)."""
        now = self.clock()
        hits, last_use = self.hits, self.last_use
        for block in blocks:
            if block.block_hash is not None:
                block_id = block.block_id
                hits[block_id] += 1
                last_use[block_id] = now

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """These blocks leave the pool's map for new content (the cached ones are remembered)."""
        evicted = [block.block_hash for block in blocks if block.block_hash is not None]
        if evicted:
            self.ghosts.add(evicted, self.clock(), self.policy)
            self.num_evicted += len(evicted)
            self.window.add(evictions=len(evicted))

    def on_reset(self, block_hashes: list[bytes]) -> None:
        """The pool forgot every cached block (a prefix-cache reset)."""
        self.ghosts.add(block_hashes, self.clock(), "reset")

    def on_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """A request's first scheduling looked up `num_prompt_tokens` and served `num_hit_tokens`
        from the cache (RAM or disk)."""
        self.window.add(queries=num_prompt_tokens, hits=num_hit_tokens)
