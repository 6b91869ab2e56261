"""Cache-aware admission: among a tenant's first waiting requests, admit the one with the longest
cached prefix first (SGLang's longest-prefix-match), with aging so that none waits forever.

When more requests wait than can run, the order decides what the cache is worth: a request whose
prefix is cached now may find it evicted if it waits behind requests that bring new prefixes in.
Each time the scheduler takes a tenant's turn, `promote_longest_prefix` moves the best of that
tenant's first `window` requests to the head of its queue: the longest hit in the RAM pool,
unless a request has been passed over `age_limit` times, which then goes first (oldest first).
It only reorders within one tenant's queue, so the fair turns between tenants stay as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.request import Request
    from prefixserve.core.sched.fair_share import WaitingQueue


def promote_longest_prefix(
    waiting: WaitingQueue,
    head: Request,
    kv_cache_manager: KVCacheManager,
    window: int = 16,
    age_limit: int = 16,
) -> Request:
    """The request of `head`'s queue to admit next (now at its head): the first one passed over
    `age_limit` times, else the longest RAM hit among the first `window` (ties: arrival order).
    Every request ahead of the chosen one counts one more pass."""
    candidates = list(waiting.requests_of(waiting.key(head), window))
    if len(candidates) < 2:
        return head
    chosen = next((r for r in candidates if r.cache.num_passed_over >= age_limit), None)
    if chosen is None:
        best = -1
        for request in candidates:
            hit = 0
            if not request.skip_reading_prefix_cache:
                hit = kv_cache_manager.get_computed_blocks(request)[1]
            if hit > best:
                chosen, best = request, hit
    assert chosen is not None
    for request in candidates:
        if request is chosen:
            break
        request.cache.num_passed_over += 1
    waiting.promote(chosen)
    return chosen
