"""One manager per attention kind: the block tables of one KV-cache group and its hit search."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.block_pool import ExtraKeysFn
    from prefixserve.core.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group: request id -> blocks, append-only except for nulls.

    Subclasses decide how a cache hit is searched and which blocks a request no longer needs.
    """

    # Whether remove_skipped_blocks can release anything (lets the coordinator skip the call).
    releases_skipped_blocks = False

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        block_size: int,
        group_id: int,
        extra_keys_fn: ExtraKeysFn | None = None,
    ) -> None:
        self.spec = spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.extra_keys_fn = extra_keys_fn
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request that are already cached (or null).
        self.num_cached_block: dict[str, int] = {}

    # ------------------------------------------------------------------ hit search

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, token_ids: list[int]
    ) -> list[KVCacheBlock]:
        """Cached blocks (null where not needed) for the longest hit of at most max_length tokens.

        The hit length is len(result) * block_size. No side effects except counting collisions.
        """
        raise NotImplementedError

    def _lookup(
        self, block_hashes: Sequence[bytes], i: int, token_ids: list[int]
    ) -> KVCacheBlock | None:
        """The cached block for the request's block i (hash and token ids must match)."""
        start = i * self.block_size
        return self.block_pool.get_cached_block(
            block_hashes[i], self.group_id, token_ids[start : start + self.block_size]
        )

    # ------------------------------------------------------------------ blocks no longer needed

    def skipped_block_indices(self, request_id: str, num_computed_tokens: int) -> range:
        """Table positions of blocks the request no longer needs once it has computed this many."""
        return range(0)

    def num_blocks_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks `remove_skipped_blocks` would return to the free queue."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        return sum(
            1
            for i in self.skipped_block_indices(request_id, num_computed_tokens)
            if not blocks[i].is_null and blocks[i].ref_cnt == 1
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks the request no longer needs (tail first); null blocks take their place."""
        indices = self.skipped_block_indices(request_id, num_computed_tokens)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        null = self.null_block
        removed = []
        for i in reversed(indices):
            block = blocks[i]
            if block.is_null:
                break  # everything before was released earlier
            removed.append(block)
            blocks[i] = null
        self.block_pool.free_blocks(removed)

    # ------------------------------------------------------------------ allocation

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks needed for `num_tokens` slots, counting hits that leave the free queue."""
        num_required = -(-num_tokens // self.block_size)
        held = self.req_to_blocks.get(request_id)
        num_new = num_required - len(new_computed_blocks) - (len(held) if held else 0)
        if num_new < 0:
            num_new = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_new += 1
        return num_new

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Append (already touched) hit blocks to a new request's table."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            assert not new_computed_blocks, "cache hits can only start a block table"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until the table holds `num_tokens` slots; return the fresh ones."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache every block of the request that is full within its first `num_tokens` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        # A request without a block hasher (or not yet hashed that far) is cached up to its hashes.
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
            self.extra_keys_fn,
        )
        self.num_cached_block[request_id] = num_full

    def uncache_from(self, request_id: str, first: int) -> None:
        """Forget the hashes of the request's blocks from table index `first` on, and count
        only the blocks before it as cached (they are cached again once computed)."""
        blocks = self.req_to_blocks.get(request_id, ())
        self.block_pool.uncache_blocks(blocks[first:])
        if self.num_cached_block.get(request_id, 0) > first:
            self.num_cached_block[request_id] = first

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (its last block will be evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: a hit is the longest run of cached blocks from the start of the prompt."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, token_ids: list[int]
    ) -> list[KVCacheBlock]:
        """Left to right, stopping at the first miss (hits must be contiguous from the start)."""
        block_size = self.block_size
        hash_to_block = self.block_pool.cached_block_hash_to_block[self.group_id]
        get_one_block = hash_to_block.get_one_block
        hits: list[KVCacheBlock] = []
        append = hits.append
        start = 0
        for block_hash in block_hashes[: max_length // block_size]:
            block = get_one_block(block_hash)
            if block is None:
                break
            end = start + block_size
            if block.token_ids != token_ids[start:end]:
                # A collision, or a later copy: the full lookup goes past the first block.
                block = hash_to_block.get(block_hash, token_ids[start:end])
                if block is None:
                    break
            append(block)
            start = end
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: only the last `sliding_window - 1` tokens before a position are needed."""

    releases_skipped_blocks = True

    def __init__(
        self,
        spec: SlidingWindowSpec,
        block_pool: BlockPool,
        block_size: int,
        group_id: int,
        extra_keys_fn: ExtraKeysFn | None = None,
    ) -> None:
        super().__init__(spec, block_pool, block_size, group_id, extra_keys_fn)
        self.sliding_window = spec.sliding_window
        # Blocks that must be cached right before a hit's end to cover the window of the first
        # token computed after it.
        self.num_contiguous_needed = -(-(spec.sliding_window - 1) // block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, token_ids: list[int]
    ) -> list[KVCacheBlock]:
        """Right to left: the last run of cached blocks long enough to cover the window.

        Blocks before that run are not needed and stand as the null block. A run reaching the
        start of the prompt is a hit of any length (nothing earlier is needed).
        """
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        needed = self.num_contiguous_needed
        hits = [self.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self._lookup(block_hashes, i, token_ids)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                del hits[i + run :]
                return hits
        del hits[run:]
        return hits

    def skipped_block_indices(self, request_id: str, num_computed_tokens: int) -> range:
        """Blocks wholly before position num_computed_tokens - sliding_window + 1."""
        num_skipped_tokens = num_computed_tokens - self.sliding_window + 1
        if num_skipped_tokens < self.block_size:
            return range(0)
        num_blocks = len(self.req_to_blocks.get(request_id, ()))
        return range(min(num_skipped_tokens // self.block_size, num_blocks))


def make_manager(
    spec: KVCacheSpec,
    block_pool: BlockPool,
    block_size: int,
    group_id: int,
    extra_keys_fn: ExtraKeysFn | None = None,
) -> SingleTypeKVCacheManager:
    """The manager for one KV-cache group's spec."""
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, block_size, group_id, extra_keys_fn)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, block_size, group_id, extra_keys_fn)
    raise ValueError(f"unsupported KV-cache spec {spec!r}")
