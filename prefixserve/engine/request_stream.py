"""What a caller of the async engine holds for one request: its pending output, and the
RequestStream that iterates it (and aborts the request when the caller stops listening).

The engine's step thread puts frozen copies of each RequestOutput (copies it will not mutate) in the
request's OutputQueue; an `ABORTED` sentinel or an exception ends the stream. Outputs are
cumulative, so the queue holds one: a newer copy replaces an unread one, and a slow reader
costs O(1) memory (vLLM's output collector does the same).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable

from prefixserve.outputs import CompletionOutput, RequestOutput


class Aborted:
    """Queue sentinel: the request was aborted before it finished."""


ABORTED = Aborted()


class OutputQueue:
    """One request's latest unread output, then possibly its end (ABORTED or an exception).

    `put` is called by the engine's step thread, `get` awaited in the caller's event loop.
    """

    __slots__ = ("loop", "_lock", "_output", "_end", "_ready", "unread_since")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._output: RequestOutput | None = None
        self._end: BaseException | Aborted | None = None
        self._ready = asyncio.Event()  # set (in the loop) whenever something may be waiting
        # When the unread output was put (monotonic seconds); None while the reader keeps up.
        self.unread_since: float | None = None

    def put(self, item: RequestOutput | BaseException | Aborted) -> None:
        """Step thread: a newer output replaces the unread one; the first end is kept.
        Raises RuntimeError when the caller's event loop is closed (nobody will read)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop of this request is closed")
        with self._lock:
            wake = self._output is None and self._end is None
            if isinstance(item, RequestOutput):
                if self._output is None:
                    self.unread_since = time.monotonic()
                self._output = item
            elif self._end is None:
                self._end = item
        if wake:
            self.loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> RequestOutput | BaseException | Aborted:
        """The latest output not read yet, else the end (returned again on every call)."""
        while True:
            with self._lock:
                if self._output is not None:
                    item, self._output = self._output, None
                    self.unread_since = None
                    return item
                if self._end is not None:
                    return self._end
                self._ready.clear()
            await self._ready.wait()

    def stalled(self, now: float, timeout_s: float) -> bool:
        """True when an output has waited unread for more than `timeout_s` seconds."""
        since = self.unread_since
        return since is not None and now - since > timeout_s


def frozen_copy(output: RequestOutput) -> RequestOutput:
    """A copy whose lists the step thread will not mutate while the loop thread reads them."""
    # Every other field as it is (the cache report is a fresh dict per output, never changed
    # after), so a field added to RequestOutput is never dropped here.
    return dataclasses.replace(
        output,
        prompt_logprobs=None if output.prompt_logprobs is None else list(output.prompt_logprobs),
        outputs=[
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ],
    )


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative `RequestOutput`s.

    Iteration ends after the output with `finished=True`, or early when the request was aborted.
    An exception or a cancellation inside the iteration aborts the request (freeing its KV
    blocks) at once; after a `break` the iterator aborts it when it is closed or collected, so
    call `abort()` (idempotent) to be explicit. A request whose event loop has closed is aborted
    by the engine thread itself.
    """

    def __init__(self, request_id: str, stream: OutputQueue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._stream = stream
        self.finished = False
        self.aborted = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished and not self.aborted:
                item = await self._stream.get()
                if isinstance(item, Aborted):
                    self.aborted = True
                    return
                if isinstance(item, BaseException):
                    self.aborted = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it finished; safe to call from any task, any number of times."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._abort(self.request_id)
