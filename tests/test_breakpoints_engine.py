"""Cache breakpoints in a real engine (the packaged model, float32): a 1-hour breakpoint survives a
W4-style flood of other prompts that evicts everything else, a hit on a breakpoint gives the
bits of a cold start, the accounting adds up, and a breakpoint never strands a queued request."""

from __future__ import annotations

import pytest

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens

BLOCK = 16
POOL = 96  # breakpoints: at most 48 blocks, 24 per tenant
ONE_HOUR = 3600


@pytest.fixture
def engine(default_model_fp32):
    engine = LLMEngine(
        EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=POOL, block_size=BLOCK)),
        loaded_model=default_model_fp32,
    )
    yield engine
    engine.check_no_leaks()


def _params(max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _run(engine: LLMEngine, request_id: str, prompt: list[int], **kwargs):
    engine.add_request(request_id, prompt, _params(), **kwargs)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def test_a_1h_breakpoint_survives_a_flood_that_evicts_everything_else(engine):
    system = random_tokens(20 * BLOCK, seed=1)
    first = _run(
        engine,
        "first",
        system + random_tokens(5, seed=2),
        tenant="t",
        cache_breakpoints=(CacheBreakpoint(len(system), ONE_HOUR),),
    )
    assert first.num_cache_write_tokens == 20 * BLOCK
    assert first.cache_write_tokens_by_ttl == {ONE_HOUR: 20 * BLOCK}
    # W4-style: prompts of their own, together more than the blocks the breakpoint leaves.
    for i in range(7):
        _run(engine, f"flood{i}", random_tokens(16 * BLOCK, seed=100 + i), tenant="other")
    other_first = random_tokens(16 * BLOCK, seed=100)
    assert (
        _run(engine, "probe", other_first[: 8 * BLOCK] + [7], tenant="other").num_cached_tokens == 0
    )
    again = _run(engine, "again", system + random_tokens(5, seed=3), tenant="t")
    assert again.num_cached_tokens == 20 * BLOCK
    assert again.num_cache_write_tokens == 0


def test_a_breakpoint_hit_gives_the_bits_of_a_cold_start(default_model_bf16):
    """In bf16, where the kernels are batch-invariant by default (config.batch_invariant): the
    tail computed over a held prefix gives the cold start's tokens and logprobs, bit for bit."""

    def bf16_engine() -> LLMEngine:
        config = CacheConfig(num_kv_blocks=POOL, block_size=BLOCK)
        return LLMEngine(
            EngineConfig(dtype="bfloat16", cache=config), loaded_model=default_model_bf16
        )

    system = random_tokens(6 * BLOCK, seed=4)
    prompt = system + random_tokens(9, seed=5)
    bp = (CacheBreakpoint(len(system), 300),)
    warm_engine, cold_engine = bf16_engine(), bf16_engine()
    _run(warm_engine, "warm", system + random_tokens(9, seed=6), tenant="t", cache_breakpoints=bp)
    hit = _run(warm_engine, "hit", prompt, tenant="t", cache_breakpoints=bp)
    assert hit.num_cached_tokens == len(system)
    cold = _run(cold_engine, "cold", prompt, tenant="t", cache_breakpoints=bp)
    assert cold.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    hit_lp = [{t: lp.logprob for t, lp in e.items()} for e in hit.outputs[0].logprobs]
    cold_lp = [{t: lp.logprob for t, lp in e.items()} for e in cold.outputs[0].logprobs]
    assert hit_lp == cold_lp
    warm_engine.check_no_leaks()
    cold_engine.check_no_leaks()


def test_prompt_tokens_split_into_read_written_and_the_rest(engine):
    system = random_tokens(4 * BLOCK, seed=7)
    history = random_tokens(3 * BLOCK + 5, seed=8)
    bps = (CacheBreakpoint(len(system), ONE_HOUR), CacheBreakpoint(len(system) + len(history), 300))
    prompt = system + history + random_tokens(6, seed=9)
    first = _run(engine, "first", prompt, tenant="t", cache_breakpoints=bps)
    assert first.num_cached_tokens == 0
    assert first.cache_write_tokens_by_ttl == {ONE_HOUR: 4 * BLOCK, 300: 3 * BLOCK}
    second = _run(
        engine, "second", prompt[:-6] + random_tokens(6, seed=10), tenant="t", cache_breakpoints=bps
    )
    assert second.num_cached_tokens == 7 * BLOCK
    assert second.num_cache_write_tokens == 0
    assert engine.get_metrics()["prefix_cache_write_tokens"] == 7 * BLOCK


def test_a_breakpoint_is_refused_rather_than_strand_a_queued_request(engine):
    system = random_tokens(20 * BLOCK, seed=11)
    engine.add_request(
        "holder",
        system + [5],
        _params(),
        tenant="t",
        cache_breakpoints=(CacheBreakpoint(len(system), 300),),
    )
    # Queued in the same step: needs 80 of the 96 blocks, so 20 held blocks would strand it.
    engine.add_request("big", random_tokens(78 * BLOCK, seed=12), _params(), tenant="u")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["big"].error is None
    assert finals["holder"].num_cache_write_tokens == 0
    assert engine.kv_cache_manager.held.breakpoints.num_blocks == 0


def test_a_prompts_samples_write_its_breakpoint_once(engine):
    system = random_tokens(5 * BLOCK, seed=13)
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=2)
    engine.add_request(
        "n3",
        system + [5, 6],
        params,
        tenant="t",
        cache_breakpoints=(CacheBreakpoint(len(system), 300),),
    )
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    [final] = finals
    assert final.num_cache_write_tokens == 5 * BLOCK
    assert engine.get_metrics()["prefix_cache_write_tokens"] == 5 * BLOCK
    assert len(engine.kv_cache_manager.held.breakpoints) == 1
