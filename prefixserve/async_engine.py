"""AsyncLLMEngine: the synchronous LLMEngine driven by a background thread, for asyncio servers.

One thread owns the engine: it is the only code that ever changes or queries its state (the
read-only properties below expose attributes fixed at construction, such as max_model_len).
Everything else talks to that thread through a command queue drained at the top of each step:

    asyncio handler --(command + future)--> queue --> step thread: run commands, engine.step()
    asyncio handler <--(call_soon_threadsafe)-- per-request asyncio.Queue <-- RequestOutputs

Adding a request is a command whose future carries the engine's validation error back to the
handler (so the server can answer 400 before it starts streaming); aborting is fire-and-forget, so
it can be called from a `finally` of a cancelled task (a client that disconnected).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixserve.outputs import RequestOutput
from prefixserve.request_stream import ABORTED, OutputQueue, RequestStream, snapshot
from prefixserve.sampling_params import SamplingParams
from prefixserve.stats_log import format_stats

if TYPE_CHECKING:
    from prefixserve.config import EngineConfig
    from prefixserve.engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
MAX_BUFFERED_KV_EVENTS = 100_000


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or was shut down; no request can be served."""


@dataclass(slots=True)
class _Command:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future[Any] | None


class AsyncLLMEngine:
    """Runs `LLMEngine.step()` in a background thread and streams outputs to asyncio callers.

    All public coroutines may be awaited from any event loop; `abort` is a plain method that may be
    called from anywhere. Call `start()` once (the server's CLI does) and `shutdown()` at exit.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        log_stats_interval_s: float | None = DEFAULT_LOG_STATS_INTERVAL_S,
        collect_kv_events: bool = False,
    ) -> None:
        self.engine = engine
        self.log_stats_interval_s = log_stats_interval_s
        self.collect_kv_events = collect_kv_events
        self._cv = threading.Condition()
        self._pending: list[_Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        # Owned by the step thread only.
        self._streams: dict[str, OutputQueue] = {}
        self._kv_events: collections.deque[Any] = collections.deque(maxlen=MAX_BUFFERED_KV_EVENTS)
        self._last_log_time = time.monotonic()
        self._last_log_metrics: dict[str, Any] | None = None
        self._steps_since_log = 0

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        from prefixserve.engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="prefixserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread; requests still streaming end with EngineDeadError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ------------------------------------------------------------------ what the engine serves
    # Fixed when the engine was built: read-only, and readable outside the step thread.
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (`encode`, `decode`, `apply_chat_template`)."""
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def model_path(self) -> Path:
        """The HF directory the weights were loaded from (the converted one for a GGUF file)."""
        return self.engine.loaded_model.path

    @property
    def max_model_len(self) -> int:
        """The context length: the most prompt plus output tokens one request may have."""
        return int(self.engine.max_model_len)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV-cache pool."""
        return int(self.engine.num_kv_blocks)

    # ------------------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ) -> RequestStream:
        """Validate and queue a request; the engine's ValueError (bad input) is raised here."""
        loop = asyncio.get_running_loop()
        stream = OutputQueue(loop, asyncio.Queue())

        def add(engine: LLMEngine) -> None:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            engine.add_request(
                request_id, prompt_token_ids, params, cache_salt=cache_salt, prompt=prompt
            )
            self._streams[request_id] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            # The caller went away while the command was queued: make sure it does not run on.
            self.abort(request_id)
            raise
        return RequestStream(request_id, stream, self.abort)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until it finishes."""
        stream = await self.add_request(request_id, prompt_token_ids, params, cache_salt, prompt)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished). Thread-safe and non-blocking."""

        def abort(engine: LLMEngine) -> None:
            stream = self._streams.pop(request_id, None)
            engine.abort_request([request_id])
            if stream is not None:
                self._deliver(request_id, stream, ABORTED)

        self._submit(_Command(abort, None, None))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(lambda e: e.reset_prefix_cache(reset_running_requests))

    async def get_metrics(self) -> dict[str, Any]:
        return await self._call(lambda e: dict(e.get_metrics()))

    async def check_no_leaks(self) -> None:
        """Raise AssertionError naming what leaked when no request is in flight (for tests)."""
        await self._call(lambda e: e.check_no_leaks())

    async def take_kv_events(self) -> list[Any]:
        """KV-cache events since the last call (only with `collect_kv_events`)."""

        def take(engine: LLMEngine) -> list[Any]:
            self._drain_kv_events()
            events = list(self._kv_events)
            self._kv_events.clear()
            return events

        return await self._call(take)

    async def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the step thread between two steps and return its result."""
        return await self._call(fn)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------------- thread plumbing
    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._submit(_Command(fn, loop, future))
        return await future

    def _submit(self, command: _Command) -> None:
        if self.dead_error is not None:
            if command.future is None:
                return
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
        with self._cv:
            self._pending.append(command)
            self._cv.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while (
                        not self._pending
                        and not self._stopping
                        and not self.engine.has_unfinished_requests()
                    ):
                        # Idle: sleep until a command comes, or until the stats of the last
                        # busy interval are due.
                        wait_s = self._seconds_until_stats_due()
                        if wait_s is not None and wait_s <= 0:
                            break
                        self._cv.wait(wait_s)
                    commands, self._pending = self._pending, []
                    stopping = self._stopping
                for command in commands:
                    self._run_command(command)
                if stopping:
                    raise EngineDeadError("the engine was shut down")
                if self.engine.has_unfinished_requests():
                    self._step()
                self._maybe_log_stats()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the loop for everyone
            if not isinstance(exc, EngineDeadError):
                logger.exception("the engine step loop failed")
            self._die(exc)

    def _run_command(self, command: _Command) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            if command.future is None:
                logger.exception("engine command failed")
            else:
                _resolve(command, _set_exception, exc)
            return
        if command.future is not None:
            _resolve(command, _set_result, result)

    def _step(self) -> None:
        outputs = self.engine.step()
        self._steps_since_log += 1
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            self._deliver(output.request_id, stream, snapshot(output))
        if self.collect_kv_events:
            self._drain_kv_events()

    def _deliver(self, request_id: str, stream: OutputQueue, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:
            # The caller's event loop is closed: nobody will read this request, so free it.
            self._streams.pop(request_id, None)
            self.engine.abort_request([request_id])

    def _drain_kv_events(self) -> None:
        if self.collect_kv_events:
            self._kv_events.extend(self.engine.take_kv_events())

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
        with self._cv:
            commands, self._pending = self._pending, []
        for command in commands:
            if command.future is not None:
                _resolve(command, _set_exception, error)
        for stream in self._streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass  # that caller's event loop is gone
        self._streams.clear()

    def _seconds_until_stats_due(self) -> float | None:
        if self.log_stats_interval_s is None or self._steps_since_log == 0:
            return None
        return self._last_log_time + self.log_stats_interval_s - time.monotonic()

    def _maybe_log_stats(self) -> None:
        interval = self.log_stats_interval_s
        if interval is None:
            return
        now = time.monotonic()
        if now - self._last_log_time < interval:
            return
        metrics = self.engine.get_metrics()
        busy = self._steps_since_log > 0 or self.engine.has_unfinished_requests()
        if busy:
            logger.info(format_stats(metrics, self._last_log_metrics, now - self._last_log_time))
        self._last_log_time = now
        self._last_log_metrics = dict(metrics)
        self._steps_since_log = 0


def _resolve(
    command: _Command, setter: Callable[[asyncio.Future[Any], Any], None], value: Any
) -> None:
    assert command.loop is not None and command.future is not None
    try:
        command.loop.call_soon_threadsafe(setter, command.future, value)
    except RuntimeError:
        pass  # the caller's event loop is closed; nobody awaits the answer


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
