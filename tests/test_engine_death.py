"""When the step loop itself fails (a forward pass raising for everyone, out of memory), the
async engine is dead and says so: every in-flight stream and every queued command gets
EngineDeadError, `on_dead` is called and `wait_dead()` returns, so the server can exit."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.exceptions import EngineDeadError
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens

LONG = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)


@pytest.fixture
def llm_engine(default_model_fp32):
    config = EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=64))
    return LLMEngine(config, loaded_model=default_model_fp32)


class _HoldFirstEnter(threading.Condition):
    """The first time `thread` takes the lock, wait until `event` is set: a command submitted
    just as the engine dies."""

    def __init__(self, thread: threading.Thread, event: threading.Event) -> None:
        super().__init__()
        self._thread, self._event, self._held = thread, event, False

    def __enter__(self):
        if threading.current_thread() is self._thread and not self._held:
            self._held = True
            self._event.wait(60)
        return super().__enter__()


def test_a_failing_step_fails_every_stream_and_every_queued_command(llm_engine):
    deaths: list[BaseException] = []
    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None, on_dead=deaths.append)
    step = llm_engine.step
    fail = threading.Event()
    died = threading.Event()

    def failing_step():
        if fail.is_set():
            raise RuntimeError("kernel fault")
        return step()

    llm_engine.step = failing_step
    die = aengine._die

    def record_death(exc):
        die(exc)
        died.set()

    aengine._die = record_death
    aengine.start()

    async def run():
        streams = [
            await aengine.add_request(EngineRequest(f"r{i}", random_tokens(10, seed=i), LONG))
            for i in range(2)
        ]
        waiter = asyncio.ensure_future(aengine.wait_dead())
        await asyncio.sleep(0)  # the waiter registers before the lock is held back below
        # The next command takes the lock only once the engine is dead: it must still be answered.
        aengine._cv = _HoldFirstEnter(threading.current_thread(), died)
        fail.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(aengine.get_metrics(), 60)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="kernel fault"):
                async for _ in stream:
                    pass
        error = await asyncio.wait_for(waiter, 60)
        assert await aengine.wait_dead() is error  # already dead: at once
        with pytest.raises(EngineDeadError):
            await aengine.add_request(EngineRequest("late", [1, 2, 3], LONG))
        return error

    error = asyncio.run(run())
    assert isinstance(error, RuntimeError) and str(error) == "kernel fault"
    assert deaths == [error]
    assert not aengine.is_running and not aengine.shutdown_requested
    assert aengine.num_streams == 0


def test_shutdown_is_a_death_that_was_asked_for(llm_engine):
    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None)
    aengine.start()
    aengine.shutdown()

    async def run():
        return await aengine.wait_dead()

    assert isinstance(asyncio.run(run()), EngineDeadError)
    assert aengine.shutdown_requested


class _FakeServer:
    should_exit = False


def test_the_server_stops_with_status_1_when_the_engine_dies_unasked(llm_engine):
    from prefixserve.entrypoints.server.supervision import EngineDeathWatch

    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None)
    server = _FakeServer()
    watch = EngineDeathWatch(aengine, server)
    aengine.on_dead = watch.on_dead

    def failing_step():
        raise RuntimeError("out of memory")

    llm_engine.step = failing_step
    aengine.start()

    async def run():
        await aengine.add_request(EngineRequest("r", random_tokens(10, seed=1), LONG))
        return await asyncio.wait_for(aengine.wait_dead(), 60)

    error = asyncio.run(run())
    # on_dead runs on the step thread after the waiters are woken: wait for it.
    deadline = time.monotonic() + 60
    while not (watch.error is not None and server.should_exit) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.error is error and server.should_exit


def test_a_requested_shutdown_does_not_stop_the_server_as_a_failure(llm_engine):
    from prefixserve.entrypoints.server.supervision import EngineDeathWatch

    aengine = AsyncLLMEngine(llm_engine, log_stats_interval_s=None)
    server = _FakeServer()
    watch = EngineDeathWatch(aengine, server)
    aengine.on_dead = watch.on_dead
    aengine.start()
    aengine.shutdown()
    assert watch.error is None and not server.should_exit
