"""The KV-cache groups of a model behind one object: they share the pool and agree on a hit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    make_manager,
)
from prefixserve.core.kv_cache.spec import KVCacheConfig

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.block_pool import ExtraKeysFn
    from prefixserve.core.request import Request

GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """One SingleTypeKVCacheManager per KV-cache group, all drawing from one BlockPool."""

    def __init__(
        self,
        config: KVCacheConfig,
        block_pool: BlockPool,
        extra_keys_fn: ExtraKeysFn | None = None,
    ) -> None:
        self.block_size = config.block_size
        self.block_pool = block_pool
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(spec, block_pool, config.block_size, group_id, extra_keys_fn)
            for group_id, spec in enumerate(config.groups)
        ]
        # Groups that release blocks a request no longer needs (sliding window).
        self.skipping_managers = [m for m in self.managers if m.releases_skipped_blocks]
        # Full-attention groups are searched first: their hit is a prefix, so a shorter limit
        # only truncates it, while the sliding-window groups may need a new search.
        self._search_order = sorted(
            range(len(self.managers)),
            key=lambda g: not isinstance(self.managers[g], FullAttentionManager),
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, token_ids: list[int]
    ) -> tuple[GroupBlocks, int]:
        """The longest hit (a multiple of block_size, at most max_length) every group agrees on.

        Each group searches under the current limit and may shorten it; the search repeats until
        no group shortens it (the length only decreases, so this ends).
        """
        block_size = self.block_size
        managers = self.managers
        if len(managers) == 1:
            hits = managers[0].find_longest_cache_hit(block_hashes, max_length, token_ids)
            return (hits,), len(hits) * block_size
        hit_length = min(max_length, len(block_hashes) * block_size) // block_size * block_size
        per_group: list[list[KVCacheBlock] | None] = [None] * len(managers)
        while True:
            shortened = False
            for group_id in self._search_order:
                manager = managers[group_id]
                previous = per_group[group_id]
                if previous is not None and isinstance(manager, FullAttentionManager):
                    hits = previous[: hit_length // block_size]
                else:
                    hits = manager.find_longest_cache_hit(block_hashes, hit_length, token_ids)
                per_group[group_id] = hits
                if len(hits) * block_size < hit_length:
                    hit_length = len(hits) * block_size
                    shortened = True
            if not shortened:
                break
        num_blocks = hit_length // block_size
        return tuple(hits[:num_blocks] for hits in per_group if hits is not None), hit_length

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks | None
    ) -> int:
        """Free blocks all groups need for `num_tokens` slots (hits leaving the queue included)."""
        total = 0
        for g, manager in enumerate(self.managers):
            hits = new_computed_blocks[g] if new_computed_blocks is not None else ()
            total += manager.get_num_blocks_to_allocate(request_id, num_tokens, hits)
        return total

    def num_blocks_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks `remove_skipped_blocks` would return to the free queue, over all groups."""
        total = 0
        for manager in self.skipping_managers:
            total += manager.num_blocks_freed_by_skipping(request_id, num_computed_tokens)
        return total

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Let each group release the blocks it no longer needs (sliding window)."""
        for manager in self.skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks) -> None:
        """Start each group's table of a new request with its (touched) hit blocks."""
        for g, manager in enumerate(self.managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[g])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        """Grow every group's table to `num_tokens` slots; return the fresh blocks per group."""
        return tuple(
            [manager.allocate_new_blocks(request_id, num_tokens) for manager in self.managers]
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's blocks that are full within its first `num_tokens` tokens."""
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        request_id = request.request_id
        for manager in self.managers:
            if manager.num_cached_block[request_id] < num_full:
                manager.cache_blocks(request, num_tokens)

    def num_cached_blocks(self, request_id: str, group_id: int = 0) -> int:
        """Leading blocks of the request's table in group `group_id` that are cached (or null);
        0 for a request holding no table."""
        return self.managers[group_id].num_cached_block.get(request_id, 0)

    def uncache_from(self, request_id: str, first: int) -> None:
        """Forget the hashes of the request's blocks from table index `first` on, in every
        group, and cap its cached count there at `first`."""
        for manager in self.managers:
            manager.uncache_from(request_id, first)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group, each table tail first."""
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """The request's block table in each group (empty lists for an unknown request)."""
        return tuple(list(manager.req_to_blocks.get(request_id, ())) for manager in self.managers)

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds a block table."""
        return request_id in self.managers[0].req_to_blocks

    def request_ids(self) -> set[str]:
        """Every request holding a block table in some group."""
        return {request_id for manager in self.managers for request_id in manager.req_to_blocks}
