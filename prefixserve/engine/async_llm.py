"""AsyncLLMEngine: the synchronous LLMEngine driven by a background thread, for asyncio servers.

One thread owns the engine: it is the only code that ever changes or queries its state (the
read-only properties below expose attributes fixed at construction, such as max_model_len).
Everything else talks to that thread through a command queue drained at the top of each step:

    asyncio handler --(command + future)--> queue --> step thread: run commands, engine.step()
    asyncio handler <--(call_soon_threadsafe)-- per-request OutputQueue <-- RequestOutputs

Adding a request is a command whose future carries the engine's validation error back (a 400
before streaming starts); aborting is fire-and-forget, callable from a `finally` of a cancelled
task. A request whose reader takes no output for `stall_timeout_s` is aborted.

When the step loop fails (a forward pass raising for everyone, out of memory), the engine is dead:
every stream and queued command gets EngineDeadError, later calls raise it, `on_dead(exc)` runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixserve.engine.client import MAX_BUFFERED_KV_EVENTS, EngineRequest, generate_outputs
from prefixserve.engine.exceptions import EngineDeadError, StreamStalledError
from prefixserve.engine.request_stream import ABORTED, OutputQueue, RequestStream, frozen_copy
from prefixserve.engine.stats_log import StatsLog
from prefixserve.lora.config import LoRARequest
from prefixserve.lora.manager import read_off_thread
from prefixserve.outputs import RequestOutput

if TYPE_CHECKING:
    from prefixserve.config import EngineConfig
    from prefixserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
DEFAULT_STALL_TIMEOUT_S = 300.0


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
        stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.log_stats_interval_s = log_stats_interval_s
        self.collect_kv_events = collect_kv_events
        self.stall_timeout_s = stall_timeout_s
        self.on_dead = on_dead  # called once, on the step thread, after the engine died
        self._cv = threading.Condition()
        self._pending: list[_Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Set under _cv: once set, no command is queued any more.
        self.dead_error: BaseException | None = None
        self._dead_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = []
        self._next_stall_check = 0.0
        # Owned by the step thread only.
        self._streams: dict[str, OutputQueue] = {}
        self._kv_events: collections.deque[Any] = collections.deque(maxlen=MAX_BUFFERED_KV_EVENTS)
        self._stats = StatsLog()
        # Fixed at construction; its `read` is pure, so the event loop's threads may call it.
        self._lora = engine.lora

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        from prefixserve.engine.llm_engine import LLMEngine

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
        if not self.is_running:
            self.engine.close()  # the disk tier's queued writes reach the disk

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def shutdown_requested(self) -> bool:
        """True after `shutdown()`: a death that was asked for, not a failure."""
        return self._stopping

    async def wait_dead(self) -> BaseException:
        """Return (the error) once the step loop has ended, by a failure or by shutdown()."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._cv:
            if self.dead_error is not None:
                return self.dead_error
            self._dead_waiters.append((future.get_loop(), future))
        return await future

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
    def enable_prompt_embeds(self) -> bool:
        return bool(self.engine.config.enable_prompt_embeds)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV-cache pool."""
        return int(self.engine.num_kv_blocks)

    @property
    def kernel_summary(self) -> str:
        """What the model computes on (`LLMEngine.kernel_summary`)."""
        return self.engine.kernel_summary

    # ------------------------------------------------------------------------------ requests
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Validate and queue a request; a new LoRA adapter is read off the step thread. The
        engine's ValueError is raised here. `final_only` and `prompt_cache_key` matter to
        replicas (start over elsewhere, route on the key); one engine has no elsewhere."""
        request_id = request.request_id
        read = await read_off_thread(self._lora, request.lora_request)
        grammar = None
        if request.params.structured_outputs is not None:  # compiled off the step thread
            grammar = await self.engine.structured_outputs.ahead(
                request.params.structured_outputs, request.tenant
            )
        loop = asyncio.get_running_loop()
        stream = OutputQueue(loop)

        def add(engine: LLMEngine) -> None:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            engine.add(request, read, grammar)
            self._streams[request_id] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            # The caller went away while the command was queued: make sure it does not run on.
            self.abort(request_id)
            raise
        return RequestStream(request_id, stream, self.abort)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add a request (as `add_request`) and yield its cumulative outputs until it finishes."""
        return generate_outputs(self, request)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished). Thread-safe and non-blocking."""

        def abort(engine: LLMEngine) -> None:
            stream = self._streams.pop(request_id, None)
            engine.abort_request([request_id])
            if stream is not None:
                self._deliver(request_id, stream, ABORTED)

        self._submit(_Command(abort, None, None))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool:
        return await self._call(lambda e: e.reset_prefix_cache(reset_running_requests, ram_only))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter as `name` (ValueError for anything that does not fit)."""
        read = await read_off_thread(self._lora, LoRARequest(name, 1, path))
        await self._call(lambda e: e.load_lora_adapter(name, path, read))

    def load_lora_adapter_now(self, name: str, path: str) -> None:
        """Load an adapter before the step thread starts (blocking; ValueError if it does not
        fit): for `--lora-modules`, checked at start-up rather than at a first request."""
        if self._thread is not None:
            raise RuntimeError(
                "load_lora_adapter_now is for before start(); await load_lora_adapter"
            )
        self.engine.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload `name`: KeyError if not loaded, LoRAInUseError while requests use it."""
        await self._call(lambda e: e.unload_lora_adapter(name))

    async def pin_prefix(self, pin_id: str, prompt_token_ids: list[int], salt: str | None) -> int:
        """Pin the cached full blocks of a prompt already run (`LLMEngine.pin_prefix`)."""
        return await self._call(lambda e: e.pin_prefix(pin_id, prompt_token_ids, salt))

    async def unpin_prefix(self, pin_id: str) -> bool:
        return await self._call(lambda e: e.unpin_prefix(pin_id))

    async def describe_pins(self) -> dict[str, Any]:
        return await self._call(lambda e: e.describe_pins())

    async def get_metrics(self) -> dict[str, Any]:
        return await self._call(lambda e: dict(e.get_metrics()))

    async def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        return await self._call(lambda e: e.cache_summary(include_text))

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
        """Run `fn(engine)` on the step thread between two steps and return its result: for
        tests and tools of this class only; the server uses `EngineClient`'s methods."""
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
        with self._cv:  # checked under the lock _die takes: a queued command is always answered
            if self.dead_error is None:
                self._pending.append(command)
                self._cv.notify()
                return
        if command.future is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")

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
                        wait_s = self._stats.seconds_until_due(self.log_stats_interval_s)
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
                self._stats.maybe_log(self.log_stats_interval_s, self.engine, logger)
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
        self._stats.steps += 1
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            self._deliver(output.request_id, stream, frozen_copy(output))
        if self.collect_kv_events:
            self._drain_kv_events()
        if self.stall_timeout_s is not None:
            self._abort_stalled(self.stall_timeout_s)

    def _abort_stalled(self, timeout_s: float) -> None:
        """Abort the requests whose reader has left an output unread for `timeout_s`."""
        now = time.monotonic()
        if now < self._next_stall_check:
            return
        self._next_stall_check = now + min(1.0, timeout_s / 2)
        stalled = [rid for rid, s in self._streams.items() if s.stalled(now, timeout_s)]
        for request_id in stalled:
            logger.warning("aborting request %s: its reader stalled", request_id)
            stream = self._streams.pop(request_id)
            self.engine.abort_request([request_id])
            error = StreamStalledError(f"no output was read for {timeout_s} s")
            self._deliver(request_id, stream, error)

    def _deliver(self, request_id: str, stream: OutputQueue, item: Any) -> None:
        try:
            stream.put(item)
        except RuntimeError:
            # The caller's event loop is closed: nobody will read this request, so free it.
            self._streams.pop(request_id, None)
            self.engine.abort_request([request_id])

    def _drain_kv_events(self) -> None:
        if self.collect_kv_events:
            self._kv_events.extend(self.engine.take_kv_events())

    def _die(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
        with self._cv:
            self.dead_error = exc
            commands, self._pending = self._pending, []
            waiters, self._dead_waiters = self._dead_waiters, []
        for command in commands:
            if command.future is not None:
                _resolve(command, _set_exception, error)
        for stream in self._streams.values():
            with contextlib.suppress(RuntimeError):  # that caller's event loop is gone
                stream.put(error)
        self._streams.clear()
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_result, future, exc)
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:  # noqa: BLE001 - the engine is dead either way
                logger.exception("the on_dead callback failed")


def _resolve(
    command: _Command, setter: Callable[[asyncio.Future[Any], Any], None], value: Any
) -> None:
    assert command.loop is not None and command.future is not None
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody awaits the answer
        command.loop.call_soon_threadsafe(setter, command.future, value)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
