"""What a caller of the async engine holds for one request: its queue of outputs, and the
RequestStream that iterates it (and aborts the request when the caller stops listening).

The engine's step thread puts snapshots of each RequestOutput (copies it will not mutate) on the
queue of the caller's event loop; an `ABORTED` sentinel or an exception ends the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prefixserve.outputs import CompletionOutput, RequestOutput


class Aborted:
    """Queue sentinel: the request was aborted before it finished."""


ABORTED = Aborted()


@dataclass(slots=True)
class OutputQueue:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException | Aborted]


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy whose lists the step thread will not mutate while the loop thread reads them."""
    return RequestOutput(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
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
        num_cached_tokens=output.num_cached_tokens,
        finished=output.finished,
        error=output.error,
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
                item = await self._stream.queue.get()
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
