"""A reader slower than the engine costs O(1) memory: a request's OutputQueue holds one unread
output, the latest cumulative snapshot. A reader that takes nothing for `stall_timeout_s` gets
its request aborted, and the abort leaves nothing behind anywhere in the engine."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.exceptions import StreamStalledError
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens


@pytest.fixture
def llm_engine(default_model_fp32):
    config = EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=512))
    return LLMEngine(config, loaded_model=default_model_fp32)


async def until_idle(aengine: AsyncLLMEngine) -> None:
    for _ in range(60_000):  # a bound against a hang, not a timing assertion
        if aengine.num_streams == 0 and not await aengine.run_in_engine(
            lambda e: e.has_unfinished_requests()
        ):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the engine never went idle")


def test_an_unread_stream_holds_only_the_latest_output(llm_engine):
    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None, stall_timeout_s=None)
    aengine.start()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run():
        stream = await aengine.add_request(EngineRequest("slow", random_tokens(10, seed=1), params))
        await until_idle(aengine)  # every step's output was put, none read
        return [out async for out in stream]

    try:
        outputs = asyncio.run(run())
    finally:
        aengine.shutdown()
    [only] = outputs
    assert only.finished and len(only.outputs[0].token_ids) == 12


def test_a_stalled_stream_is_aborted_and_leaves_nothing_behind(llm_engine):
    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None, stall_timeout_s=0.01)
    aengine.start()
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=500, ignore_eos=True)

    async def run():
        stream = await aengine.add_request(
            EngineRequest("stalled", random_tokens(10, seed=2), params)
        )
        await until_idle(aengine)
        outputs = []
        with pytest.raises(StreamStalledError):
            async for out in stream:
                outputs.append(out)
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert [o.finished for o in outputs] == [False]  # the last one put, then the abort
    engine = aengine.engine
    engine.check_no_leaks()
    assert not engine.runner._seeded_generators
    assert not engine.output_processor.prompt_ids()
    assert not engine.scheduler.finished_req_ids
    assert not aengine._streams
