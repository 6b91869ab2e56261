"""KVCacheManager.num_cached_blocks, the public query prefill dedup (core/sched/prefill_dedup.py)
asks instead of the per-group managers' `num_cached_block`: it must answer as they do.

This file may read the internals: it checks the public answer against them.
"""

from __future__ import annotations

from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from prefixserve.core.sched.prefill_dedup import prefill_in_flight
from tests.helpers.kv_cache import BLOCK_SIZE, make_manager, make_request

HYBRID = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=8)]


def internal_counts(mgr: KVCacheManager, request) -> list[int]:
    return [m.num_cached_block.get(request.request_id, 0) for m in mgr.coordinator.managers]


def public_counts(mgr: KVCacheManager, request) -> list[int]:
    return [mgr.num_cached_blocks(request, g) for g in range(mgr.num_groups)]


def internal_in_flight(running, mgr: KVCacheManager) -> set[bytes]:
    """prefill_in_flight as it was written against the internals."""
    manager = mgr.coordinator.managers[0]
    hashes: set[bytes] = set()
    for request in running:
        prompt_blocks = min(request.num_prompt_tokens // BLOCK_SIZE, len(request.block_hashes))
        cached = manager.num_cached_block.get(request.request_id, 0)
        if cached < prompt_blocks:
            hashes.update(request.block_hashes[cached:prompt_blocks])
    return hashes


def test_num_cached_blocks_answers_as_the_internals_through_chunks_hits_uncache_and_free():
    mgr = make_manager(num_blocks=40, groups=HYBRID)
    prompt = list(range(10 * BLOCK_SIZE + 2))
    first = make_request("first", prompt)
    second = make_request("second", prompt + [99] * 5)
    assert public_counts(mgr, first) == internal_counts(mgr, first) == [0, 0]  # unknown: 0

    seen: list[list[int]] = []

    def compare() -> None:
        for request in (first, second):
            assert public_counts(mgr, request) == internal_counts(mgr, request)
        assert prefill_in_flight([first, second], mgr) == internal_in_flight([first, second], mgr)
        seen.append(public_counts(mgr, first))

    # Chunked prefill of `first`, 3 blocks a step: its cached count grows chunk by chunk.
    while first.num_computed_tokens < first.num_tokens:
        chunk = min(3 * BLOCK_SIZE, first.num_tokens - first.num_computed_tokens)
        assert mgr.allocate_slots(first, chunk) is not None
        first.num_computed_tokens += chunk
        compare()
        if first.num_computed_tokens == 6 * BLOCK_SIZE:
            # `second` arrives mid-prefill: it hits the six cached blocks.
            blocks, hit = mgr.get_computed_blocks(second)
            assert hit == 6 * BLOCK_SIZE
            assert mgr.allocate_slots(second, BLOCK_SIZE, hit, blocks) is not None
            second.num_computed_tokens = hit + BLOCK_SIZE
            compare()
            assert public_counts(mgr, second) == [7, 7]
    assert [counts[0] for counts in seen] == [3, 6, 6, 9, 10]
    assert prefill_in_flight([first], mgr) == set()  # every full prompt block is cached

    # A failed step: blocks from the one holding token 5 * BLOCK_SIZE on are forgotten.
    mgr.uncache_uncomputed_blocks(first, 5 * BLOCK_SIZE)
    compare()
    assert public_counts(mgr, first) == [5, 5]
    assert prefill_in_flight([first], mgr) == set(first.block_hashes[5:10])

    mgr.free(first)
    mgr.free(second)
    compare()
    assert public_counts(mgr, first) == [0, 0]
    mgr.check_no_leaks()
