"""Shared builders for the cache-core tests."""

from __future__ import annotations

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig
from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(
    request_id: str,
    tokens: list[int],
    block_size: int = BLOCK_SIZE,
    hash_fn="sha256",
    sampling_params: SamplingParams | None = None,
    **kwargs,
) -> Request:
    return Request(
        request_id,
        tokens,
        sampling_params or SamplingParams(),
        block_hasher=get_request_block_hasher(block_size, hash_fn),
        **kwargs,
    )


def make_manager(
    num_blocks: int = 11,
    block_size: int = BLOCK_SIZE,
    groups=None,
    enable_caching: bool = True,
    events: bool = False,
    eviction_policy: str = "lru",
    max_pinned_blocks: int = 0,
) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks, block_size=block_size, groups=groups or [FullAttentionSpec()]
    )
    return KVCacheManager(
        config,
        enable_caching=enable_caching,
        enable_kv_cache_events=events,
        eviction_policy=eviction_policy,
        max_pinned_blocks=max_pinned_blocks,
    )


def schedule(mgr: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Admit a waiting request like the scheduler does: look up, allocate, advance.

    Returns the hit length, or None when allocation failed.
    """
    blocks, num_computed = mgr.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_computed
    new = mgr.allocate_slots(request, num_new_tokens, num_computed, blocks)
    if new is None:
        return None
    request.num_computed_tokens = num_computed + num_new_tokens
    return num_computed


def decode(mgr: KVCacheManager, request: Request, token: int) -> bool:
    """One decode step: the sampled token is appended, then its slot is allocated."""
    request.append_output_token_ids(token)
    new = mgr.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    if new is None:
        return False
    request.num_computed_tokens = request.num_tokens
    return True


def free_ids(pool: BlockPool) -> list[int]:
    return pool.free_block_queue.block_ids()


def evict_block(pool: BlockPool, block: KVCacheBlock) -> None:
    """Evict one free cached block where it stands, as a pop from the queue would."""
    assert block.ref_cnt == 0 and block.block_hash is not None
    pool.free_block_queue.remove(block)
    pool._evict([block])
    pool.free_block_queue.append(block)


def snapshot(mgr: KVCacheManager, requests=()) -> tuple:
    """Everything a call could change, except the hash-collision counter (a diagnostic that a
    lookup bumps when it meets a colliding hash)."""
    pool = mgr.block_pool
    stats = mgr.make_prefix_cache_stats()
    stats.hash_collisions = 0
    return (
        free_ids(pool),
        [(b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
        [dict(m.items()) for m in pool.cached_block_hash_to_block],
        [mgr.get_block_ids(r) for r in requests],
        stats,
        list(pool.events),
    )
