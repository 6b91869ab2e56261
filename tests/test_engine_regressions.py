"""Engine rules found by review: seeded streams across preemption, bad option combinations."""

from __future__ import annotations

import random

import pytest

from prefixserve import LLM, SamplingParams


def _random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def test_seeded_sampling_is_identical_with_and_without_preemption(default_model_fp32):
    prompts = [{"prompt_token_ids": _random_tokens(30, seed=70 + i)} for i in range(4)]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]

    def sample(num_kv_blocks: int) -> tuple[list[list[int]], int]:
        llm = LLM(dtype="float32", loaded_model=default_model_fp32, num_kv_blocks=num_kv_blocks)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()["num_preemptions"]

    roomy, roomy_preemptions = sample(200)
    tight, tight_preemptions = sample(10)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_prompt_logprobs_refuse_an_explicit_cache_read():
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert SamplingParams(prompt_logprobs=0).skips_prefix_cache_read
    assert SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=True).skips_prefix_cache_read


def test_a_failed_step_leaves_no_cached_block_without_its_kv(default_model_fp32):
    llm = LLM(dtype="float32", loaded_model=default_model_fp32, num_kv_blocks=64)
    prompt = [{"prompt_token_ids": _random_tokens(70, seed=5)}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = LLM(
        dtype="float32",
        loaded_model=default_model_fp32,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    ).generate(prompt, greedy, use_tqdm=False)[0]

    runner = llm.llm_engine.runner
    execute = runner.execute

    def interrupted(scheduler_output):
        raise KeyboardInterrupt

    runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, greedy, use_tqdm=False)
    runner.execute = execute
    llm.llm_engine.check_no_leaks()

    again = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize(
    ("window", "block_size", "max_chunk", "num_tokens"),
    [(8, 4, 16, 40), (8, 4, 5, 41), (512, 16, 4096, 1100), (7, 4, 3, 30), (16, 16, 64, 200)],
)
def test_a_request_that_passes_the_pool_check_can_run_alone_in_that_pool(
    window, block_size, max_chunk, num_tokens
):
    from prefixserve.kv_cache.sizing import blocks_needed as _blocks_needed
    from prefixserve.kv_cache.hashing import get_request_block_hasher
    from prefixserve.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
    from prefixserve.request import Request

    groups = [SlidingWindowSpec(sliding_window=window), FullAttentionSpec()]
    pool = _blocks_needed(groups, num_tokens, block_size, max_chunk)
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=pool + 1, block_size=block_size, groups=groups),
        enable_caching=True,
    )
    request = Request(
        "r",
        _random_tokens(num_tokens, seed=1),
        SamplingParams(),
        block_hasher=get_request_block_hasher(block_size),
    )
    while request.num_computed_tokens < num_tokens:
        chunk = min(max_chunk, num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, chunk) is not None, request.num_computed_tokens
        request.num_computed_tokens += chunk
    manager.free(request)
    manager.check_invariants()
