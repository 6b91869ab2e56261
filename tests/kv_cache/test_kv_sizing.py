"""Pool sizing: what a request may need (a request the admission check lets in can always run,
alone, in that pool), what the pool gets, and the leak check of an idle pool."""

from __future__ import annotations

import pytest

from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.sizing import blocks_needed, size_kv_pool
from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens


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


def test_pool_size_is_the_explicit_number_when_given():
    kwargs = dict(default_memory_gb=1.0, bytes_per_block=1000, max_num_seqs=4, blocks_per_request=8)
    assert size_kv_pool(num_kv_blocks=7, kv_cache_memory_gb=None, **kwargs) == 7


def test_pool_size_from_a_memory_budget_and_a_budget_too_small_for_one_block():
    kwargs = dict(default_memory_gb=1.0, max_num_seqs=4, blocks_per_request=8)
    gib = 1 << 30
    assert (
        size_kv_pool(
            num_kv_blocks=None, kv_cache_memory_gb=0.5, bytes_per_block=gib // 64, **kwargs
        )
        == 32
    )
    with pytest.raises(ValueError, match="holds no KV block"):
        size_kv_pool(num_kv_blocks=None, kv_cache_memory_gb=0.5, bytes_per_block=gib, **kwargs)


def test_default_pool_is_capped_at_every_running_request_at_full_length():
    kwargs = dict(num_kv_blocks=None, kv_cache_memory_gb=None, bytes_per_block=1 << 20)
    # 1 GiB holds 1024 blocks of 1 MiB; 4 requests of 8 blocks need only 32.
    assert size_kv_pool(default_memory_gb=1.0, max_num_seqs=4, blocks_per_request=8, **kwargs) == 32
    assert (
        size_kv_pool(default_memory_gb=1.0, max_num_seqs=400, blocks_per_request=8, **kwargs)
        == 1024
    )


def test_check_no_leaks_names_a_request_still_holding_blocks():
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=9, block_size=4, groups=[FullAttentionSpec()]),
        enable_caching=True,
    )
    request = Request(
        "holder",
        random_tokens(8, seed=2),
        SamplingParams(),
        block_hasher=get_request_block_hasher(4),
    )
    assert manager.allocate_slots(request, 8) is not None
    with pytest.raises(AssertionError, match="holder"):
        manager.check_no_leaks()
    manager.free(request)
    manager.check_no_leaks()
