"""Never compute one prefix twice at once.

The pool caches a block's hash when its slots are allocated, before the forward pass fills it, so
a request admitted in the same step as, or after, the one computing a block already hits it. What
is left is chunked prefill: a running request computing a long prompt chunk by chunk has only
its chunks so far cached; a second request with the same prefix would hit those and then compute
the next blocks itself, in parallel with the first. Here the scheduler finds such a request (its
first uncached block is one that a running request's prompt will compute) and leaves it waiting
for a step or more, until those blocks are cached and it hits them. It cannot wait forever: the
running request either computes the block or leaves (finished, preempted, aborted), and then the
block is no longer in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.request import Request


def prefill_in_flight(running: Iterable[Request], kv_cache_manager: KVCacheManager) -> set[bytes]:
    """Hashes of the full prompt blocks running requests have still to compute (those past the
    blocks already cached for them, in the first KV-cache group)."""
    num_cached_blocks = kv_cache_manager.num_cached_blocks
    block_size = kv_cache_manager.block_size
    hashes: set[bytes] = set()
    for request in running:
        prompt_blocks = min(request.num_prompt_tokens // block_size, len(request.block_hashes))
        cached = num_cached_blocks(request)
        if cached < prompt_blocks:
            hashes.update(request.block_hashes[cached:prompt_blocks])
    return hashes


def waits_for_prefill(
    request: Request, num_hit_tokens: int, block_size: int, in_flight: set[bytes]
) -> bool:
    """Whether `request`'s first block after its hit of `num_hit_tokens` is being computed by a
    running request (then it should wait and hit it, instead of computing it again)."""
    if not in_flight or request.skip_reading_prefix_cache:
        return False
    index = num_hit_tokens // block_size
    return index < len(request.block_hashes) and request.block_hashes[index] in in_flight
