"""AsyncLLMEngine: the engine's step loop in a thread, streamed to asyncio callers."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from prefixserve.engine.client import EngineRequest
from prefixserve.engine.stats_log import format_stats
from prefixserve.sampling_params import SamplingParams
from tests.helpers.server import MAX_MODEL_LEN, NUM_KV_BLOCKS


def rid() -> str:
    return f"test-{uuid.uuid4().hex}"


def test_generate_streams_cumulative_outputs_until_finished(async_engine, tokenizer):
    ids = tokenizer.encode("Hello there")

    async def run():
        return [
            out
            async for out in async_engine.generate(
                EngineRequest(
                    rid(), ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
                )
            )
        ]

    outputs = asyncio.run(run())
    # A reader slower than the steps sees only the latest cumulative output (one pending output
    # per request), so outputs may be skipped, never repeated or reordered.
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_add_request_raises_the_engines_validation_error(async_engine):
    async def run():
        await async_engine.add_request(EngineRequest(rid(), [], SamplingParams(max_tokens=1)))

    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(run())


def test_a_duplicate_request_id_is_refused(async_engine, tokenizer):
    ids = tokenizer.encode("Twice")
    request_id = rid()

    async def run():
        stream = await async_engine.add_request(
            EngineRequest(request_id, ids, SamplingParams(max_tokens=50, ignore_eos=True))
        )
        try:
            with pytest.raises(ValueError, match="already in use"):
                await async_engine.add_request(
                    EngineRequest(request_id, ids, SamplingParams(max_tokens=1))
                )
        finally:
            stream.abort()

    asyncio.run(run())


def test_abort_mid_stream_ends_the_iteration_and_frees_the_blocks(async_engine, tokenizer, server):
    server.wait_idle()
    ids = tokenizer.encode("A long one")

    async def run():
        stream = await async_engine.add_request(
            EngineRequest(rid(), ids, SamplingParams(max_tokens=500, ignore_eos=True))
        )
        seen = 0
        async for output in stream:
            seen = len(output.outputs[0].token_ids)
            if seen == 2:
                stream.abort()
        return stream, seen

    stream, seen = asyncio.run(run())
    assert stream.aborted and not stream.finished
    assert seen < 500
    after = server.wait_idle()
    assert after["kv_cache_usage"] == 0
    server.check_no_leaks()


def test_a_request_whose_event_loop_closed_is_aborted_and_the_engine_lives_on(
    async_engine, tokenizer, server
):
    server.wait_idle()
    before = server.metrics()

    async def abandon():
        stream = await async_engine.add_request(
            EngineRequest(
                rid(),
                tokenizer.encode("Abandoned"),
                SamplingParams(max_tokens=500, ignore_eos=True),
            )
        )
        # Keep a reference, so nothing closes the iterator: only the closed loop tells.
        iterator = aiter(stream)
        await anext(iterator)
        return stream, iterator

    kept = asyncio.run(abandon())
    after = server.wait_idle()
    assert after["generation_tokens"] - before["generation_tokens"] < 500
    server.check_no_leaks()
    assert async_engine.is_running
    del kept


def test_concurrent_requests_from_two_event_loops(async_engine, tokenizer):
    import threading

    results = {}

    def worker(name: str) -> None:
        async def run():
            outs = [
                o
                async for o in async_engine.generate(
                    EngineRequest(
                        rid(), tokenizer.encode(name), SamplingParams(max_tokens=4, ignore_eos=True)
                    )
                )
            ]
            return outs[-1]

        results[name] = asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("first loop", "second loop")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {n: len(o.outputs[0].token_ids) for n, o in results.items()} == {
        "first loop": 4,
        "second loop": 4,
    }


def test_format_stats_reports_interval_throughput_and_hit_rate():
    previous = {
        "prompt_tokens": 100,
        "generation_tokens": 50,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 0,
    }
    now = {
        "prompt_tokens": 300,
        "generation_tokens": 150,
        "prefix_cache_queries": 300,
        "prefix_cache_hits": 150,
        "num_running": 3,
        "num_waiting": 1,
        "kv_cache_usage": 0.25,
    }
    line = format_stats(now, previous, 10.0)
    assert "prompt throughput 20.0 tok/s" in line
    assert "generation throughput 10.0 tok/s" in line
    assert "running 3 reqs" in line and "waiting 1 reqs" in line
    assert "KV cache usage 25.0%" in line
    assert "prefix cache hit rate 75.0%" in line
    assert "hit rate n/a" in format_stats(now, now, 10.0)


def test_a_busy_engine_logs_the_periodic_stats_line(async_engine, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="prefixserve.engine.async_llm")
    previous = async_engine.log_stats_interval_s
    async_engine.log_stats_interval_s = 0.0  # every step, for this test
    try:

        async def run():
            async for _ in async_engine.generate(
                EngineRequest(
                    rid(), tokenizer.encode("Log me"), SamplingParams(max_tokens=3, ignore_eos=True)
                )
            ):
                pass

        asyncio.run(run())
    finally:
        async_engine.log_stats_interval_s = previous
    lines = [r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage()]
    assert lines
    assert all("KV cache usage" in line and "prefix cache hit rate" in line for line in lines)


def test_the_public_properties_tell_what_the_engine_serves(async_engine):
    assert async_engine.max_model_len == MAX_MODEL_LEN
    assert async_engine.num_kv_blocks == NUM_KV_BLOCKS
    assert (async_engine.model_path / "config.json").is_file()
    assert async_engine.tokenizer.decode(async_engine.tokenizer.encode("Hi there")) == "Hi there"
