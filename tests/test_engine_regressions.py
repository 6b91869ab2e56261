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
