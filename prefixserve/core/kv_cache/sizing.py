"""How many KV blocks a request may need at once, and how many the pool gets.

Pure arithmetic over the KV-cache specs: the engine sizes its pool with `size_kv_pool` and
refuses, at admission, a request that `blocks_needed` says could never fit.
"""

from __future__ import annotations

import math

from prefixserve.core.kv_cache.spec import KVCacheSpec, SlidingWindowSpec

_GIB = 1 << 30


def blocks_needed(
    groups: list[KVCacheSpec], num_tokens: int, block_size: int, max_chunk: int
) -> int:
    """Blocks a request holding `num_tokens` tokens of K/V may need at once, over all groups,
    when one step computes at most `max_chunk` of its tokens.

    A sliding-window group holds the window behind the chunk plus the chunk itself: blocks
    covering `sliding_window - 1 + chunk` positions, one more when they straddle a boundary.
    """
    full = math.ceil(num_tokens / block_size)
    chunk = min(max_chunk, num_tokens)
    total = 0
    for spec in groups:
        if isinstance(spec, SlidingWindowSpec):
            total += min(full, math.ceil((spec.sliding_window - 1 + chunk) / block_size) + 1)
        else:
            total += full
    return total


def size_kv_pool(
    *,
    num_kv_blocks: int | None,
    kv_cache_memory_gb: float | None,
    default_memory_gb: float,
    bytes_per_block: int,
    max_num_seqs: int,
    blocks_per_request: int,
) -> int:
    """The number of allocatable blocks: `num_kv_blocks` when given, else what
    `kv_cache_memory_gb` holds (ValueError when that is not one block), else the default budget
    capped at every running request at full length (`max_num_seqs * blocks_per_request`)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory_gb is not None:
        num = int(kv_cache_memory_gb * _GIB) // bytes_per_block
        if num < 1:
            raise ValueError(
                f"kv_cache_memory_gb={kv_cache_memory_gb} holds no KV block "
                f"(one block takes {bytes_per_block} bytes)"
            )
        return num
    budget = int(default_memory_gb * _GIB) // bytes_per_block
    return max(1, min(budget, max_num_seqs * blocks_per_request))
