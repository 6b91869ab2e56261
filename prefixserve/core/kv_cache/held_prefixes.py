"""`HeldPrefixes`: the prefixes kept resident beside the KV-cache manager, one facade over the
operator's pins (`pins.py`) and the clients' cache breakpoints (`breakpoints.py`).

The KV-cache manager keeps vLLM's API (look up, allocate, cache, free); what no request owns but
the pool must keep lives here: which blocks are held, by whom, how many, and what a request can
still hold at most beside them. Both kinds hold blocks by a reference of their own, so a held
block is never free and never evicted until its holder lets it go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint, HoldStatus
from prefixserve.core.kv_cache.breakpoints import HeldBreakpoints
from prefixserve.core.kv_cache.coordinator import KVCacheCoordinator
from prefixserve.core.kv_cache.pins import PinnedPrefixes
from prefixserve.core.request import Request


class HeldPrefixes:
    """Pins and breakpoints over one pool. `max_breakpoint_blocks` defaults to half the pool,
    `max_breakpoint_blocks_per_tenant` to a quarter."""

    def __init__(
        self,
        block_pool: BlockPool,
        coordinator: KVCacheCoordinator,
        block_size: int,
        enable_caching: bool,
        max_pinned_blocks: int = 0,
        max_breakpoint_blocks: int | None = None,
        max_breakpoint_blocks_per_tenant: int | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_kv_blocks = block_pool.num_kv_blocks
        self.pins = PinnedPrefixes(block_pool, max_pinned_blocks)
        num_kv = self.num_kv_blocks
        self.breakpoints = HeldBreakpoints(
            block_pool,
            num_kv // 2 if max_breakpoint_blocks is None else max_breakpoint_blocks,
            num_kv // 4
            if max_breakpoint_blocks_per_tenant is None
            else max_breakpoint_blocks_per_tenant,
        )

    def pin_prefix(self, pin_id: str, request: Request) -> int:
        """Keep the cached blocks of `request`'s prompt resident (`pins.py`); returns the tokens
        pinned (its full blocks that are cached, from the start). ValueError when none is
        cached, for a used id, or past the pinned capacity."""
        if not self.enable_caching:
            raise ValueError("cannot pin a prefix with prefix caching off")
        groups, num_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens, request.all_token_ids
        )
        self.pins.pin(pin_id, groups, num_tokens)
        return num_tokens

    def holders(self) -> Counter[int]:
        """Block id -> holders among pins and breakpoints (blocks no request can take)."""
        return self.pins.holders() + self.breakpoints.holders()

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by pins or breakpoints."""
        if not len(self.breakpoints):
            return self.pins.num_blocks
        return len(self.holders())

    def hold_breakpoints(
        self,
        request: Request,
        breakpoints: tuple[CacheBreakpoint, ...],
        fits_pool: Callable[[int], bool],
    ) -> list[HoldStatus]:
        """Hold the cached full blocks of each breakpoint's prefix of `request` (its blocks are
        in its table now, cached) for its ttl (`breakpoints.py`). `fits_pool(n)`: whether n
        more held blocks leave every queued request room."""
        statuses = []
        for bp in breakpoints:
            num_blocks = bp.num_tokens // self.block_size
            if not self.enable_caching or num_blocks == 0:
                statuses.append(HoldStatus.NOT_CACHED)
                continue
            blocks = [
                block
                for manager in self.coordinator.managers
                for block in manager.req_to_blocks.get(request.request_id, ())[:num_blocks]
            ]
            if len(request.block_hashes) < num_blocks:
                statuses.append(HoldStatus.NOT_CACHED)
                continue
            key = request.block_hashes[num_blocks - 1]
            statuses.append(
                self.breakpoints.hold(
                    request.tenant, key, blocks, num_blocks * self.block_size, bp.ttl_s, fits_pool
                )
            )
        return statuses

    def expire_breakpoints(self) -> int:
        """Release the breakpoints past their expiry; how many."""
        return self.breakpoints.expire()

    def refresh_breakpoints(self, request: Request, num_hit_tokens: int) -> None:
        """`request` read its first `num_hit_tokens` from the cache: the breakpoints ending
        inside that run were used (their expiry moves on)."""
        num_blocks = num_hit_tokens // self.block_size
        if num_blocks and len(self.breakpoints):
            self.breakpoints.refresh_read(request.block_hashes[:num_blocks])

    def blocks_available_to(self, request: Request) -> int:
        """The most blocks `request` can ever hold at once: the pool less the held blocks
        (pins and breakpoints), plus the held blocks its own prompt hits (it shares those, so
        they cost it nothing).

        A request that needs more can never run, however long it waits."""
        held = self.holders()
        available = self.num_kv_blocks - len(held)
        if not held or not self.enable_caching or request.skip_reading_prefix_cache:
            return available
        groups, _ = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1, request.all_token_ids
        )
        return available + sum(1 for group in groups for block in group if block.block_id in held)

    def clear(self) -> None:
        """Drop every pin and breakpoint (a prefix-cache reset)."""
        self.pins.clear()
        self.breakpoints.clear()
