"""The prefix-cache core (pure Python, no torch): which KV blocks a request can reuse.

Read in data-flow order: hashing -> block (one physical block) -> eviction/ (the free queue:
lru, slru, cost_aware) -> block_pool -> single_type -> coordinator -> kv_cache_manager (sizing:
how many blocks a request needs and the pool gets; held_prefixes: pins and breakpoints).
"""

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from prefixserve.core.kv_cache.hashing import get_hash_fn, get_request_block_hasher, init_none_hash
from prefixserve.core.kv_cache.kv_cache_manager import (
    KVCacheBlocks,
    KVCacheManager,
    PrefixCacheStats,
)
from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheManager",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "get_hash_fn",
    "get_request_block_hasher",
    "init_none_hash",
]
