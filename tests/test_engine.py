"""Prefix caching through the whole engine, with the packaged default model (greedy).

The model runs in float32 here: with a cache hit, or another batch cut, the same tokens go
through matmuls of other shapes, and in bfloat16 that rounding difference alone can flip a greedy
token (see BENCHMARKS.md); in float32 greedy outputs must match exactly.
Every test ends with `check_no_leaks()`: all blocks back in the free pool, no request left.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockStored
from tests.helpers import random_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def token_prompts(*prompts: list[int], salt: str | None = None) -> list[dict]:
    return [
        {"prompt_token_ids": p} | ({"cache_salt": salt} if salt is not None else {})
        for p in prompts
    ]


@pytest.fixture
def llm(default_model_exact):
    model = default_model_exact
    llm = LLM(dtype=model.config.dtype, loaded_model=model, num_kv_blocks=256)
    yield llm
    llm.llm_engine.check_no_leaks()


def run(llm: LLM, prompts: list[dict], params: SamplingParams = GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


# ----------------------------------------------------------------------------- hits


def test_same_17_token_prompt_twice_second_hits_one_full_block(llm):
    prompt = random_tokens(17, seed=1)
    [first] = run(llm, token_prompts(prompt))
    [second] = run(llm, token_prompts(prompt))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_requests"] == 2
    assert metrics["prefix_cache_queries"] == 34
    assert metrics["prefix_cache_hits"] == 16


def test_identical_100_token_prompts_together_second_computes_only_the_partial_block(llm):
    prompt = random_tokens(100, seed=2)
    first, second = run(llm, token_prompts(prompt, prompt))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 96)
    assert llm.get_metrics()["computed_prompt_tokens"] == 100 + 100 % 16
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_multi_turn_follow_up_hits_the_generated_tokens_blocks(llm):
    turn1 = random_tokens(40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [out1] = run(llm, token_prompts(turn1), params)
    generated = out1.outputs[0].token_ids
    turn2 = turn1 + generated + random_tokens(10, seed=4)
    [out2] = run(llm, token_prompts(turn2), GREEDY)
    # The last generated token was never fed back, so its K/V does not exist yet.
    assert out2.num_cached_tokens == (len(turn1) + len(generated) - 1) // 16 * 16 == 64
    assert out2.num_cached_tokens > len(turn1)


def test_cache_salt_isolates_identical_prompts(llm):
    prompt = random_tokens(40, seed=5)
    [a1] = run(llm, token_prompts(prompt, salt="tenant-a"))
    [b1] = run(llm, token_prompts(prompt, salt="tenant-b"))
    [unsalted] = run(llm, token_prompts(prompt))
    [a2] = run(llm, token_prompts(prompt, salt="tenant-a"))
    assert (a1.num_cached_tokens, b1.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 32
    # Submitted together: the salted twin does not ride on the other's blocks either.
    other = random_tokens(40, seed=6)
    c, d = run(
        llm,
        [
            {"prompt_token_ids": other, "cache_salt": "c"},
            {"prompt_token_ids": other, "cache_salt": "d"},
        ],
    )
    assert (c.num_cached_tokens, d.num_cached_tokens) == (0, 0)
    assert a1.outputs[0].token_ids == b1.outputs[0].token_ids == a2.outputs[0].token_ids


def test_prompt_logprobs_skip_the_cache_read_match_an_uncached_run_and_write_blocks(
    default_model_fp32,
):
    prompt = random_tokens(37, seed=7)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    cold = LLM(
        dtype="float32",
        loaded_model=default_model_fp32,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    [reference] = run(cold, token_prompts(prompt), with_logprobs)
    cold.llm_engine.check_no_leaks()

    llm = LLM(dtype="float32", loaded_model=default_model_fp32, num_kv_blocks=64)
    run(llm, token_prompts(prompt))  # caches the prompt's blocks
    [out] = run(llm, token_prompts(prompt), with_logprobs)
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, (got, want) in enumerate(
        zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True), start=1
    ):
        assert prompt[pos] in got
        assert got[prompt[pos]].logprob == want[prompt[pos]].logprob, pos
        assert {t: lp.logprob for t, lp in got.items()} == {t: lp.logprob for t, lp in want.items()}
    # Blocks written by the prompt_logprobs request serve a later reader.
    llm.reset_prefix_cache()
    run(llm, token_prompts(prompt), with_logprobs)
    [reader] = run(llm, token_prompts(prompt + [5]))
    assert reader.num_cached_tokens == 32
    llm.llm_engine.check_no_leaks()


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = random_tokens(40, seed=8)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=3)
    [out] = run(llm, token_prompts(prompt), params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    # Sample 0 computes the prompt; samples 1 and 2 hit its 2 full blocks in the same step.
    assert llm.get_metrics()["computed_prompt_tokens"] == 40 + 2 * 8


# ----------------------------------------------------------------------------- equality


def _outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = run(llm, token_prompts(*prompts), params)
    llm.llm_engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_outputs_identical_under_eviction_and_preemption_in_float32(default_model_fp32):
    # Four 30-token prompts fill an 8-block pool (2 blocks each); at token 32 every request
    # needs a third block, so the newest ones are preempted, their blocks evicted and reused.
    prompts = [random_tokens(30, seed=20 + i) for i in range(4)]
    prompts.append(list(prompts[1]))
    model = default_model_fp32
    reference = _outputs(
        LLM(dtype="float32", loaded_model=model, num_kv_blocks=64, enable_prefix_caching=False),
        prompts,
        8,
    )
    tiny = LLM(dtype="float32", loaded_model=model, num_kv_blocks=8)
    assert _outputs(tiny, prompts, 8) == reference
    metrics = tiny.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["prefix_cache_preempted_hits"] > 0  # resumed requests re-hit their blocks


@settings(
    max_examples=3,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 10_000),
    prefix_len=st.integers(8, 40),
    suffix_lens=st.lists(st.integers(1, 20), min_size=2, max_size=3),
    budget=st.sampled_from([7, 16, 33]),
    num_kv_blocks=st.integers(4, 8),
)
def test_greedy_outputs_identical_with_caching_on_and_off_in_float32(
    default_model_fp32, seed, prefix_len, suffix_lens, budget, num_kv_blocks
):
    """Caching, eviction, preemption and chunked prefill change which K/V are reused and how
    the batch is cut, never the greedy tokens (float32)."""
    prefix = random_tokens(prefix_len, seed)
    prompts = [prefix + random_tokens(n, seed + 1 + i) for i, n in enumerate(suffix_lens)]
    prompts.append(list(prompts[0]))  # an exact repeat
    model = default_model_fp32
    reference = _outputs(
        LLM(dtype="float32", loaded_model=model, num_kv_blocks=64, enable_prefix_caching=False),
        prompts,
        5,
    )
    # The longest request alone needs ceil((60 + 5 - 1) / 16) = 4 blocks.
    llm = LLM(
        dtype="float32",
        loaded_model=model,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=5 if seed % 2 else 0,
    )
    assert _outputs(llm, prompts, 5) == reference
    assert _outputs(llm, prompts, 5) == reference  # again, over whatever the pool kept
    metrics = llm.get_metrics()
    event(f"preempted: {metrics['num_preemptions'] > 0}")
    event(f"hit: {metrics['prefix_cache_hits'] > 0}")


# ----------------------------------------------------------------------------- lifecycle


def test_abort_frees_every_block(default_model_bf16):
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", random_tokens(40, 9), SamplingParams(max_tokens=50))
    engine.add_request("b", random_tokens(20, 10), SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.get_metrics()["kv_cache_usage"] > 0
    engine.abort_request(["a", "b", "never-added"])
    assert not engine.has_unfinished_requests()
    engine.check_no_leaks()


def test_reset_prefix_cache_forgets_hits_and_can_reset_running_requests(default_model_fp32):
    llm = LLM(dtype="float32", loaded_model=default_model_fp32, num_kv_blocks=64)
    engine = llm.llm_engine
    prompt = random_tokens(33, 12)
    [first] = run(llm, token_prompts(prompt))
    assert llm.reset_prefix_cache()
    [again] = run(llm, token_prompts(prompt))
    assert again.num_cached_tokens == 0

    engine.add_request("r", prompt, GREEDY)
    engine.step()
    assert not engine.reset_prefix_cache()  # blocks in use
    assert engine.reset_prefix_cache(reset_running_requests=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.get_metrics()["num_preemptions"] == 1
    engine.check_no_leaks()


def test_kv_events_report_stored_blocks_and_clears(default_model_bf16):
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=64, enable_kv_events=True)
    run(llm, token_prompts(random_tokens(35, 13)))
    events = llm.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2  # 35 prompt + 3 fed back = 2 blocks
    assert llm.take_kv_events() == []
    assert llm.reset_prefix_cache()
    assert any(isinstance(e, AllBlocksCleared) for e in llm.take_kv_events())
    llm.llm_engine.check_no_leaks()


def test_seeded_sampling_is_identical_with_and_without_preemption(default_model_exact):
    """A preempted request recomputes its K/V in other batches: with a batch-invariant bf16
    engine (or float32) its seeded samples are the same."""
    prompts = [{"prompt_token_ids": random_tokens(30, seed=70 + i)} for i in range(4)]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]

    def sample(num_kv_blocks: int) -> tuple[list[list[int]], int]:
        model = default_model_exact
        llm = LLM(dtype=model.config.dtype, loaded_model=model, num_kv_blocks=num_kv_blocks)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.check_no_leaks()
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()["num_preemptions"]

    roomy, roomy_preemptions = sample(200)
    tight, tight_preemptions = sample(10)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_a_failed_step_leaves_no_cached_block_without_its_kv(default_model_fp32):
    llm = LLM(dtype="float32", loaded_model=default_model_fp32, num_kv_blocks=64)
    prompt = [{"prompt_token_ids": random_tokens(70, seed=5)}]
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
