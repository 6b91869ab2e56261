"""Pool sizing: a request the admission check lets in can always run, alone, in that pool."""

from __future__ import annotations

import pytest
from helpers import random_tokens

from prefixserve.kv_cache.hashing import get_request_block_hasher
from prefixserve.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.kv_cache.sizing import blocks_needed
from prefixserve.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from prefixserve.request import Request
from prefixserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("window", "block_size", "max_chunk", "num_tokens"),
    [(8, 4, 16, 40), (8, 4, 5, 41), (512, 16, 4096, 1100), (7, 4, 3, 30), (16, 16, 64, 200)],
)
def test_a_request_that_passes_the_pool_check_can_run_alone_in_that_pool(
    window, block_size, max_chunk, num_tokens
):
    groups = [SlidingWindowSpec(sliding_window=window), FullAttentionSpec()]
    pool = blocks_needed(groups, num_tokens, block_size, max_chunk)
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=pool + 1, block_size=block_size, groups=groups),
        enable_caching=True,
    )
    request = Request(
        "r",
        random_tokens(num_tokens, seed=1),
        SamplingParams(),
        block_hasher=get_request_block_hasher(block_size),
    )
    while request.num_computed_tokens < num_tokens:
        chunk = min(max_chunk, num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, chunk) is not None, request.num_computed_tokens
        request.num_computed_tokens += chunk
    manager.free(request)
    manager.check_invariants()
