"""Pins and admission, composed: a pinned block is not a block any other request can take, so a
request is admitted against the pool less the pins (plus the pinned blocks of its own prefix), a
pin may not strand a queued request, and a request that still ends up unable to get blocks fails
alone while the engine goes on (issue 26, finding 1)."""

from __future__ import annotations

import pytest

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.core.request import Request
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens

BLOCK = 16
POOL = 96  # max_pinned_blocks defaults to a quarter: 24


@pytest.fixture
def engine(default_model_fp32):
    engine = LLMEngine(
        EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=POOL)),
        loaded_model=default_model_fp32,
    )
    yield engine
    engine.check_no_leaks()


def params(max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drain(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def pin_system_prompt(engine: LLMEngine, num_blocks: int = 24) -> list[int]:
    system = random_tokens(num_blocks * BLOCK + 1, seed=1)  # the last token is never cached
    engine.add_request("warm", system, params(1))
    drain(engine)
    assert engine.pin_prefix("system", system) == num_blocks * BLOCK
    return system


def test_a_request_is_admitted_against_the_pool_less_the_pinned_blocks(engine):
    pin_system_prompt(engine)
    # 80 blocks fit the pool of 96 but not the 72 the pins leave: refused, not queued.
    with pytest.raises(ValueError, match="24 of the pool's blocks are pinned"):
        engine.add_request("big", random_tokens(80 * BLOCK - 2, seed=2), params())
    assert not engine.has_unfinished_requests()
    engine.add_request("small", random_tokens(40, seed=3), params())
    assert drain(engine)["small"].error is None


def test_a_request_may_use_the_pinned_blocks_of_its_own_prefix(engine):
    system = pin_system_prompt(engine)
    # 24 pinned blocks it shares + 56 of its own: 80 in all, of which only 56 come from the 72.
    prompt = system[:-1] + random_tokens(56 * BLOCK - 2, seed=4)
    engine.add_request("shares", prompt, params())
    out = drain(engine)["shares"]
    assert out.error is None and out.num_cached_tokens == 24 * BLOCK


def test_a_pin_that_would_strand_a_queued_request_is_refused(engine):
    system = random_tokens(24 * BLOCK + 1, seed=1)
    engine.add_request("warm", system, params(1))
    drain(engine)
    engine.add_request("big", random_tokens(80 * BLOCK - 2, seed=2), params())
    with pytest.raises(ValueError, match="would leave queued request 'big'"):
        engine.pin_prefix("system", system)
    assert engine.kv_cache_manager.held.pins.num_blocks == 0
    assert drain(engine)["big"].error is None


def test_a_request_that_cannot_get_blocks_from_an_idle_pool_fails_alone(engine):
    system = random_tokens(24 * BLOCK + 1, seed=1)
    engine.add_request("warm", system, params(1))
    drain(engine)
    engine.add_request("big", random_tokens(80 * BLOCK - 2, seed=2), params())
    # A pin made below the engine's check (as a bug might): the request is stuck, not the engine.
    probe = Request("probe", system, SamplingParams(), block_hasher=engine.parts.block_hasher)
    engine.kv_cache_manager.held.pin_prefix("system", probe)
    finals = drain(engine)
    assert "cannot get its KV blocks" in finals["big"].error
    assert finals["big"].outputs[0].finish_reason == "error"
    engine.add_request("after", random_tokens(40, seed=3), params())
    assert drain(engine)["after"].error is None
    engine.unpin_prefix("system")
