"""KVCacheManager: what the scheduler calls to look up, allocate, cache and free KV blocks."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.coordinator import KVCacheCoordinator
from prefixserve.core.kv_cache.events import KVCacheEvent
from prefixserve.core.kv_cache.eviction.policies import DEFAULT_EVICTION_POLICY
from prefixserve.core.kv_cache.hashing import generate_block_extra_keys, get_hash_fn
from prefixserve.core.kv_cache.held_prefixes import HeldPrefixes
from prefixserve.core.kv_cache.reports.ghost import DEFAULT_GHOST_ENTRIES
from prefixserve.core.kv_cache.reports.recorder import BlockRecorder
from prefixserve.core.kv_cache.spec import KVCacheConfig
from prefixserve.core.request import Request


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request, one list per KV-cache group (group order = config.groups order)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks in the first group (every group has the same table length)."""
        return len(self.blocks[0]) if self.blocks else 0

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups since the manager was built.

    A request is counted once per admission (its first successful allocate_slots after a lookup
    it was allowed to make); `queries` are the tokens it looked up and `hits` the tokens reused.
    Requests re-admitted after preemption (num_preemptions > 0) are counted apart.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hash_collisions: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (fresh requests only); 0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Prefix-cache lookups and block allocation for every request, over all KV-cache groups.

    `eviction_policy` names the free queue's policy: "lru" (the default), "slru" or "cost"
    (`eviction/policies.py`); another name is a ValueError listing them.

    Callers outside `core/kv_cache/` go through these methods and `held` (`held_prefixes.py`:
    pins and breakpoints) only, never the coordinator or its per-group managers.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        max_pinned_blocks: int = 0,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        ghost_entries: int = DEFAULT_GHOST_ENTRIES,
        max_breakpoint_blocks: int | None = None,
        max_breakpoint_blocks_per_tenant: int | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = enable_caching
        # Per-block history for cache reports and the summary (`reports/`); `ghost_entries`
        # bounds the memory of evicted hashes.
        self.recorder = BlockRecorder(config.num_blocks, eviction_policy, ghost_entries)
        self.block_pool = BlockPool(
            config.num_blocks,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            num_groups=len(config.groups),
            eviction_policy=eviction_policy,
            recorder=self.recorder if enable_caching else None,
        )
        # Extra keys are recomputed only for BlockStored events (the hashes already hold them).
        extra_keys_fn = partial(generate_block_extra_keys, hash_fn=get_hash_fn(config.hash_algo))
        self.coordinator = KVCacheCoordinator(config, self.block_pool, extra_keys_fn)
        self.num_groups = len(config.groups)
        self._stats = PrefixCacheStats()
        # The operator's pins and the clients' cache breakpoints (`held_prefixes.py`): blocks
        # no request owns that the pool keeps.
        self.held = HeldPrefixes(
            self.block_pool,
            self.coordinator,
            self.block_size,
            enable_caching,
            max_pinned_blocks,
            max_breakpoint_blocks,
            max_breakpoint_blocks_per_tenant,
        )

    # ------------------------------------------------------------------ sizes

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_kv_blocks(self) -> int:
        """Allocatable blocks (num_blocks - 1: the null block is not counted)."""
        return self.block_pool.num_kv_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use."""
        return self.block_pool.usage

    def empty_blocks(self) -> KVCacheBlocks:
        """A KVCacheBlocks with no block in any group."""
        return KVCacheBlocks(tuple([] for _ in range(self.num_groups)))

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of the request already cached, as (blocks, num_computed_tokens).

        A hit is a contiguous run of full blocks from the start, agreed on by every group, and
        never more than request.num_tokens - 1 tokens (the last token is recomputed for its
        logits). Nothing is returned when caching is off or the request skips reading the cache.
        No side effects: blocks are touched by allocate_slots.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_blocks(), 0
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, request.all_token_ids
        )
        return KVCacheBlocks(blocks), num_tokens

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` (+ lookahead) tokens after the computed ones.

        `num_new_computed_tokens` / `new_computed_blocks` are a new request's cache hit from
        get_computed_blocks. Slots are made for request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens tokens. Returns the
        fresh blocks per group, or None, changing nothing, when the free queue is too short
        (hit blocks with ref count 0 count as needed, since touching them takes them off it).

        On success: releases the blocks sliding-window groups no longer need, touches the hits,
        appends them and fresh blocks to the block tables, and caches every block that is full
        within min(computed + num_new_tokens, request.num_tokens) tokens, so lookahead tokens are
        never cached and an identical prompt scheduled next in the same step already hits.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        coordinator = self.coordinator
        request_id = request.request_id
        hits = None
        if new_computed_blocks is not None and self.enable_caching:
            hits = new_computed_blocks.blocks
        num_hit_blocks = len(hits[0]) if hits else 0
        if num_new_computed_tokens != num_hit_blocks * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} must equal the tokens of "
                f"new_computed_blocks ({num_hit_blocks} blocks of {self.block_size}), as returned "
                "by get_computed_blocks"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens

        num_needed = coordinator.get_num_blocks_to_allocate(request_id, num_slots, hits)
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if num_needed > num_free and num_needed > num_free + (
            coordinator.num_blocks_freed_by_skipping(request_id, request.num_computed_tokens)
        ):
            return None

        is_admission = not coordinator.has_request(request_id)
        if coordinator.skipping_managers:
            coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        if hits is not None:
            touch = self.block_pool.touch
            for group_hits in hits:
                touch(group_hits)
            coordinator.save_new_computed_blocks(request_id, hits)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_slots)
        if self.enable_caching:
            # Only tokens known to be in the sequence: lookahead (draft) slots are never cached.
            coordinator.cache_blocks(
                request, min(num_computed + num_new_tokens, request.num_tokens)
            )
            if is_admission and not request.skip_reading_prefix_cache:
                self._record_lookup(request, num_new_computed_tokens)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's blocks that are full within its first `num_tokens` tokens, which
        must be computed (K/V written) and in the sequence: accepted drafts, whose blocks become
        full after allocate_slots ran for the step."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))

    def _record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup in the prefix-cache stats."""
        stats = self._stats
        if request.num_preemptions > 0:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first in each group. Cached blocks stay hittable."""
        self.coordinator.free(request.request_id)

    def uncache_uncomputed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Forget the hashes of `request`'s blocks from the one holding token
        `num_computed_tokens` on, in every group.

        allocate_slots caches blocks before the forward pass writes their K/V; when that pass
        fails, or a disk-tier read meant to fill them fails, those blocks hold garbage and must
        never be hit. The request's cached count goes back too, so a request that goes on caches
        them again once they are computed.
        """
        self.coordinator.uncache_from(request.request_id, num_computed_tokens // self.block_size)

    def uncache_block_ids(self, block_ids: Iterable[int]) -> None:
        """Forget the hashes of these blocks (disk-tier loads of a step whose pass failed: the
        K/V may never have been written into them)."""
        blocks = self.block_pool.blocks
        self.block_pool.uncache_blocks([blocks[block_id] for block_id in block_ids])

    # ------------------------------------------------------------------ inspection

    def get_blocks(self, request: Request) -> KVCacheBlocks:
        """The request's block tables (a copy)."""
        return KVCacheBlocks(self.coordinator.get_blocks(request.request_id))

    def num_cached_blocks(self, request: Request, group_id: int = 0) -> int:
        """Leading blocks of `request`'s table in KV-cache group `group_id` that are cached (or
        null): its hits and the full blocks it has computed, or is computing this step
        (allocate_slots caches a step's full blocks before the forward pass). 0 for a request
        holding no blocks. The blocks after these are the ones it has still to compute and
        cache."""
        return self.coordinator.num_cached_blocks(request.request_id, group_id)

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """The request's block ids, one list per group; 0 stands for the null block."""
        return tuple(
            [block.block_id for block in manager.req_to_blocks.get(request.request_id, ())]
            for manager in self.coordinator.managers
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative prefix-cache stats (they are never reset)."""
        snapshot = dataclasses.replace(self._stats)
        snapshot.hash_collisions = self.block_pool.num_hash_collisions
        return snapshot

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, drop every pin and breakpoint; False (and nothing changed)
        while a request holds blocks."""
        if self.coordinator.request_ids():
            return False
        self.held.clear()
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events recorded since the last call (empty unless events are enabled)."""
        return self.block_pool.take_events()

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the pool or block tables.

        Checked: the pool's own invariants (free queue links, ref count 0 iff free, free +
        in use == total, map entries carry their hash); each block's ref count equals the number
        of block tables holding it; a table's cached prefix carries hashes; nulls only lead.
        """
        self.block_pool.check_invariants()
        holders: Counter[int] = self.held.holders()
        for manager in self.coordinator.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                num_cached = manager.num_cached_block[request_id]
                assert num_cached <= len(blocks), f"{request_id}: cached past its table"
                seen_real = False
                for i, block in enumerate(blocks):
                    if block.is_null:
                        assert not seen_real, f"{request_id}: null block after a real block"
                        continue
                    seen_real = True
                    holders[block.block_id] += 1
                    if self.enable_caching and i < num_cached:
                        assert block.block_hash is not None, (
                            f"{request_id}: block {i} ({block!r}) should be cached"
                        )
                        assert block.group_id == manager.group_id, (
                            f"{request_id}: {block!r} cached for another group"
                        )
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block!r}: ref count {block.ref_cnt} but {holders[block.block_id]} holders"
            )

    def check_no_leaks(self) -> None:
        """With no request running: raise AssertionError naming what leaked, a request still
        holding a block table or a block neither free nor pinned (then check_invariants); blocks
        held by breakpoints count as pinned."""
        holders = self.coordinator.request_ids()
        assert not holders, f"the KV-cache manager still holds block tables of {sorted(holders)}"
        self.check_invariants()
        pinned = self.held.num_blocks
        assert self.num_free_blocks + pinned == self.num_kv_blocks, (
            f"{self.num_kv_blocks - self.num_free_blocks - pinned} of {self.num_kv_blocks} "
            f"KV blocks are neither free nor pinned with no request running"
        )
