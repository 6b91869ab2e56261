"""What every dialect's routes share about one request: the server's state (`ServerState`),
admitting a request and adding it to the engine (`start_request`), and answering it as an SSE
stream (`stream_response`) or as one JSON body that a client's disconnect aborts
(`collect_response`, over `final_output`).

The engine validates the request (token ids in the vocabulary, prompt and max_tokens within the
context, the KV pool); its ValueError comes back from `add_request` before any header is sent and
leaves as a 400 naming the endpoint's field. A structured request's grammar compiles inside
`add_request` too: a bad one is the engine's ValueError (a 400), a tenant with too many compiles
in flight a GrammarBusy (a 429).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from prefixserve.engine.client import EngineClient, EngineRequest
from prefixserve.engine.exceptions import EngineDeadError
from prefixserve.engine.request_stream import RequestStream
from prefixserve.entrypoints.chat.history import GeneratedHistory
from prefixserve.entrypoints.server.admission import Admission, Ticket
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.errors import (
    RETRY_AFTER_S,
    OpenAIError,
    capacity_refusal,
    engine_stopped,
    from_value_error,
    request_failed,
)
from prefixserve.entrypoints.server.inspector_sessions import InspectorSessions
from prefixserve.entrypoints.server.metrics import ServerMetrics
from prefixserve.entrypoints.server.summary_feed import SummaryFeed
from prefixserve.entrypoints.server.tokenizer_queue import TokenizerQueue
from prefixserve.outputs import RequestOutput
from prefixserve.structured_output.errors import GrammarBusy

T = TypeVar("T")


@dataclass(slots=True)
class ServerState:
    """What the handlers share: the engine, the names it answers to, keys, metrics."""

    engine: EngineClient  # one engine (AsyncLLMEngine) or replicas (ClusterEngine)
    served_model_names: list[str]
    api_keys: ApiKeys | None = None
    # LoRA adapters a request may name in `model`: name -> (lora_int_id, path) (models.py).
    lora_modules: dict[str, tuple[int, str]] = field(default_factory=dict)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    admission: Admission = field(default_factory=Admission)
    # The inspector's browser sessions (with API keys only: inspector_sessions.py).
    inspector_sessions: InspectorSessions | None = None
    # Tokenizing and chat-template rendering run here, off the event loop, one at a time (a
    # tokenizer is not safe to call from several threads at once), tenants taken in turn.
    tokenizer_queue: TokenizerQueue = field(default_factory=TokenizerQueue)
    # Chat answers' computed token ids, per tenant, reused by the next turn's prompt
    # (entrypoints/chat/history.py).
    history: GeneratedHistory = field(default_factory=GeneratedHistory)
    # The cache summary of the operator routes (serving_cache.py), built once per interval.
    summary_feed: SummaryFeed = field(init=False)
    # The next LoRA adapters' ids: never one an adapter had before, even after its unload.
    lora_ids: Iterator[int] = field(init=False)

    def __post_init__(self) -> None:
        self.summary_feed = SummaryFeed(self.engine)
        self.lora_ids = itertools.count(
            max((i for i, _ in self.lora_modules.values()), default=0) + 1
        )


def server_state(raw: Request) -> ServerState:
    """The state of the app that serves `raw` (server/app.py `build_shell` keeps it there).

    The routes are module functions that find their state here, never closures over it: FastAPI
    keeps every endpoint callable it has seen in process-wide caches, so a closure would keep
    its app's engine alive after the app is gone (in every process that builds several apps)."""
    return cast(ServerState, raw.app.state.server)


async def start_request(
    state: ServerState,
    raw: Request,
    request: EngineRequest,
    num_prompt: int,
    fields: Mapping[str, str] | None = None,
) -> tuple[RequestStream, Ticket]:
    """Admit `request` (admission.py: its tenant's share of requests and tokens in flight) and
    add it to the engine: its stream and admission ticket. The engine's ValueError leaves as a
    400 naming the endpoint's field (`fields`), a tenant's grammar compiles past its bound as a
    429 and a dead engine as a 503, both with Retry-After."""
    params = request.params
    max_tokens = params.max_tokens or max(1, state.engine.max_model_len - num_prompt)
    ticket = state.admission.admit(raw.state.tenant, params.n * (num_prompt + max_tokens))
    try:
        stream = await state.engine.add_request(request)
    except ValueError as exc:
        state.admission.release(ticket)
        raise from_value_error(exc, fields) from exc
    except GrammarBusy as exc:
        state.admission.release(ticket)
        raise capacity_refusal(f"too many requests: {exc}", "too_many_grammar_compiles") from exc
    except BaseException as exc:
        state.admission.release(ticket)
        if isinstance(exc, EngineDeadError):
            raise engine_stopped_retry_later() from exc
        raise
    return stream, ticket


def stream_response(
    state: ServerState, chunks: AsyncIterator[str], ticket: Ticket
) -> StreamingResponse:
    """An SSE response of `chunks`, releasing the admission ticket when it ends."""
    release = BackgroundTask(state.admission.release, ticket)
    return StreamingResponse(
        state.admission.released_after(chunks, ticket),
        media_type="text/event-stream",
        background=release,
    )


async def collect_response(
    state: ServerState,
    raw: Request,
    work: Awaitable[dict[str, Any]],
    stream: RequestStream,
    ticket: Ticket,
) -> Response:
    """The JSON body `work` collects, or 499 (the request aborted) when the client goes first."""
    try:
        final = await _unless_disconnected(raw, work)
    finally:
        stream.abort()
        state.admission.release(ticket)
    if final is None:  # the client is gone; nobody reads this
        raw.state.error_code = "client_closed"
        return Response(status_code=499)
    return JSONResponse(final)


async def _unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; cancel it (aborting its request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(
    stream: RequestStream, observe: Callable[[RequestOutput], object]
) -> RequestOutput:
    """The finished output of `stream`, `observe` called on each on the way; a dead engine is
    a 503 with Retry-After, the request's own failure a 500, an abort a 503 (both APIs' views
    collect through this)."""
    final: RequestOutput | None = None
    try:
        async for output in stream:
            observe(output)
            final = output
    except EngineDeadError as exc:
        raise engine_stopped_retry_later() from exc
    if final is not None and final.error is not None:
        raise request_failed(final.error)
    if final is None or not final.finished:
        raise OpenAIError(
            "the request was aborted before it finished", status_code=503, type="server_error"
        )
    return final


def engine_stopped_retry_later() -> OpenAIError:
    """The 503 of a request its engine could not finish, before anything of it was sent: with
    replicas another one (or a restarted server) can take the retry."""
    error = engine_stopped()
    error.headers = {"Retry-After": str(RETRY_AFTER_S)}
    return error
