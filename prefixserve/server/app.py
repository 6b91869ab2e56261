"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLMEngine.

One request's path: authenticate (API key -> tenant) -> parse and range-check the body
(protocol.py) -> tokenize (text, token ids or chat messages) -> check it against the context ->
SamplingParams -> derive the engine's cache salt from (tenant, client cache_salt) -> add to the
engine -> stream or collect the RequestOutputs -> OpenAI response with
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixserve.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from prefixserve.outputs import Logprob, RequestOutput
from prefixserve.sampling_params import SamplingParams
from prefixserve.server import protocol as p
from prefixserve.server.auth import ApiKeys, derive_cache_salt, parse_bearer
from prefixserve.server.errors import OpenAIError, from_value_error, install_error_handlers
from prefixserve.server.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class ServerState:
    """What the handlers share: the engine, the names it answers to, keys, metrics."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    api_keys: ApiKeys | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    model_root: str | None = None
    max_model_len: int = 0
    vocab_size: int = 0


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    api_keys: ApiKeys | None = None,
    model_root: str | None = None,
) -> FastAPI:
    """The FastAPI app. The caller starts and stops `engine` (see cli.py)."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    state = ServerState(
        engine=engine,
        served_model_names=list(served_model_names),
        api_keys=api_keys,
        model_root=model_root,
        max_model_len=int(engine.engine.max_model_len),
        vocab_size=int(engine.engine.vocab_size),
    )
    app = FastAPI(title="prefixserve", summary="OpenAI-compatible LLM server with prefix caching")
    app.state.server = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        # Unauthenticated on purpose: load balancers probe it.
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    router = APIRouter(dependencies=[Depends(_authenticate)])

    @router.get("/v1/models")
    async def list_models() -> p.ModelList:
        return p.ModelList(
            data=[
                p.ModelCard(
                    id=name, root=state.model_root or name, max_model_len=state.max_model_len
                )
                for name in state.served_model_names
            ]
        )

    @router.post("/v1/completions")
    async def create_completion(body: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = _check_model(state, body.model)
        prompt = _completion_prompt(state, body)
        return await _serve(state, raw, body, model, prompt, arrival, chat=False)

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        model = _check_model(state, body.model)
        prompt = _chat_prompt(state, body)
        return await _serve(state, raw, body, model, prompt, arrival, chat=True)

    @router.get("/metrics")
    async def metrics() -> Response:
        state.metrics.update_engine(await engine.get_metrics())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        raw: Request, reset_running_requests: bool | None = None
    ) -> JSONResponse:
        # The flag may come as a query parameter (vLLM) or in a JSON body.
        if reset_running_requests is None:
            reset_running_requests = False
            if await raw.body():
                try:
                    body = p.ResetPrefixCacheRequest.model_validate_json(await raw.body())
                except ValueError as exc:
                    raise OpenAIError(
                        f"invalid body for /reset_prefix_cache: {exc}",
                        param="reset_running_requests",
                    ) from exc
                reset_running_requests = body.reset_running_requests
        ok = await engine.reset_prefix_cache(reset_running_requests)
        return JSONResponse({"success": bool(ok)})

    @router.get("/kv_events")
    async def kv_events() -> JSONResponse:
        """KV-cache events since the last call (needs --kv-events)."""
        if not engine.collect_kv_events:
            raise OpenAIError(
                "KV-cache events are off; start the server with --kv-events",
                status_code=404,
                code="kv_events_disabled",
            )
        events = await engine.take_kv_events()
        return JSONResponse({"events": [_event_json(e) for e in events]})

    app.include_router(router)
    return app


async def _authenticate(request: Request) -> None:
    """Resolve the caller's tenant from `Authorization: Bearer <key>` into request.state."""
    state: ServerState = request.app.state.server
    request.state.tenant = None
    if state.api_keys is None:
        return
    token = parse_bearer(request.headers.get("authorization"))
    tenant = None if token is None else state.api_keys.tenant_for(token)
    if tenant is None:
        message = (
            "missing API key: send 'Authorization: Bearer <key>'"
            if token is None
            else "invalid API key"
        )
        raise OpenAIError(message, status_code=401, code="invalid_api_key")
    request.state.tenant = tenant


# ------------------------------------------------------------------------------------ prompts
def _completion_prompt(
    state: ServerState, body: p.CompletionRequest
) -> tuple[list[int], str | None]:
    prompt = body.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        return state.engine.tokenizer.encode(prompt), prompt
    if not prompt:
        raise OpenAIError("prompt must not be an empty list of token ids", param="prompt")
    bad = next((t for t in prompt if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise OpenAIError(
            f"prompt token id {bad} is outside the vocabulary [0, {state.vocab_size})",
            param="prompt",
        )
    return list(prompt), None


def _chat_prompt(state: ServerState, body: p.ChatCompletionRequest) -> tuple[list[int], str | None]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt
        )
    except ValueError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    except Exception as exc:  # a template raising on these messages (e.g. role order)
        raise OpenAIError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    if not ids:
        raise OpenAIError("the messages render to an empty prompt", param="messages")
    return list(ids), None


def _sampling_params(
    state: ServerState, body: p.CompletionRequest | p.ChatCompletionRequest, num_prompt: int
) -> SamplingParams:
    if isinstance(body, p.ChatCompletionRequest):
        max_tokens = body.effective_max_tokens
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_param = "messages"
    else:
        max_tokens = body.max_tokens
        max_tokens_param = "max_tokens"
        logprobs = body.logprobs
        prompt_param = "prompt"
    limit = state.max_model_len
    if num_prompt >= limit:
        raise OpenAIError(
            f"the prompt has {num_prompt} tokens but the context holds {limit} "
            f"(max_model_len) and the output needs at least one; "
            f"send at most {limit - 1} prompt tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > limit:
        raise OpenAIError(
            f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt} tokens is past the "
            f"context of {limit} tokens; {max_tokens_param} may be at most {limit - num_prompt}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs,
        )
    except ValueError as exc:
        raise from_value_error(exc) from exc


# ----------------------------------------------------------------------------------- serving
async def _serve(
    state: ServerState,
    raw: Request,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    model: str,
    prompt: tuple[list[int], str | None],
    arrival: float,
    chat: bool,
) -> Response:
    prompt_ids, prompt_text = prompt
    params = _sampling_params(state, body, len(prompt_ids))
    cache_salt = derive_cache_salt(raw.state.tenant, body.cache_salt)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        stream = await state.engine.add_request(
            request_id, prompt_ids, params, cache_salt=cache_salt, prompt=prompt_text
        )
    except ValueError as exc:
        raise from_value_error(exc) from exc
    except EngineDeadError as exc:
        raise OpenAIError(str(exc), status_code=503, type="server_error") from exc
    view = _ResponseView(state, request_id, model, body, chat, RequestTimer(state.metrics, arrival))
    if body.stream:
        return StreamingResponse(view.stream(stream), media_type="text/event-stream")
    try:
        final = await _unless_disconnected(raw, view.collect(stream))
    finally:
        stream.abort()
    if final is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(final)


def _check_model(state: ServerState, model: str | None) -> str:
    if model is None:
        return state.served_model_names[0]
    if model not in state.served_model_names:
        raise OpenAIError(
            f"the model {model!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in state.served_model_names)}",
            status_code=404,
            param="model",
            code="model_not_found",
        )
    return model


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


@dataclass(slots=True)
class _ChoiceState:
    sent_text: int = 0  # characters of text already streamed
    sent_tokens: int = 0  # token ids (and logprobs) already streamed
    num_tokens: int = 0
    finished: bool = False
    role_sent: bool = False


class _ResponseView:
    """Turns one request's cumulative RequestOutputs into OpenAI responses or SSE chunks."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        model: str,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        chat: bool,
        timer: RequestTimer,
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.model = model
        self.body = body
        self.chat = chat
        self.timer = timer
        self.created = int(time.time())
        self.choices = [_ChoiceState() for _ in range(body.n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._token_text: dict[int, str] = {}
        if chat:
            self.num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            self.num_logprobs = body.logprobs

    # -------------------------------------------------------------------- shared bookkeeping
    def _observe(self, output: RequestOutput) -> None:
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        for completion in output.outputs:
            self.choices[completion.index].num_tokens = len(completion.token_ids)
        self.timer.on_tokens(time.monotonic(), sum(c.num_tokens for c in self.choices))

    def _finish(self, output: RequestOutput | None) -> None:
        reasons = [] if output is None else [c.finish_reason for c in output.outputs]
        self.timer.on_finish(time.monotonic(), reasons)
        self.state.metrics.cached_prompt_tokens.inc(self.cached_tokens)

    def usage(self) -> p.UsageInfo:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return p.UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def _token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._token_text.get(token_id)
        if text is None:
            text = self.state.engine.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------------------ logprobs
    def _top(self, entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
        k = self.num_logprobs or 0
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)
        return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]

    def completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int
    ) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        offset = text_offset
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            token = self._token_str(token_id, chosen)
            out.tokens.append(token)
            out.token_logprobs.append(None if chosen is None else chosen.logprob)
            top = {self._token_str(t, lp): lp.logprob for t, lp in self._top(entry)}
            if chosen is not None:
                top.setdefault(token, chosen.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]]
    ) -> p.ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            token = self._token_str(token_id, chosen)
            content.append(
                p.ChatTokenLogprob(
                    token=token,
                    logprob=-9999.0 if chosen is None else chosen.logprob,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        p.TopLogprob(
                            token=(s := self._token_str(t, lp)),
                            logprob=lp.logprob,
                            bytes=list(s.encode("utf-8")),
                        )
                        for t, lp in self._top(entry)
                    ],
                )
            )
        return p.ChatLogprobs(content=content)

    def prompt_logprobs(
        self, output: RequestOutput
    ) -> list[dict[str, p.PromptLogprob] | None] | None:
        if output.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(t): p.PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=self._token_str(t, lp)
                )
                for t, lp in entry.items()
            }
            for entry in output.prompt_logprobs
        ]

    # ------------------------------------------------------------------------ non-streaming
    async def collect(self, stream: RequestStream) -> dict[str, Any] | None:
        final: RequestOutput | None = None
        try:
            async for output in stream:
                self._observe(output)
                final = output
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), status_code=503, type="server_error") from exc
        if final is None or not final.finished:
            raise OpenAIError(
                "the request was aborted before it finished", status_code=503, type="server_error"
            )
        self._finish(final)
        if self.chat:
            return p.ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[
                    p.ChatChoice(
                        index=c.index,
                        message=p.ChatMessageOut(content=c.text),
                        logprobs=None
                        if c.logprobs is None
                        else self.chat_logprobs(c.token_ids, c.logprobs),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(final) if c.index == 0 else None,
                    )
                    for c in final.outputs
                ],
                usage=self.usage(),
            ).model_dump(mode="json")
        return p.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                p.CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=None
                    if c.logprobs is None
                    else self.completion_logprobs(c.token_ids, c.logprobs, 0),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(final) if c.index == 0 else None,
                )
                for c in final.outputs
            ],
            usage=self.usage(),
        ).model_dump(mode="json")

    # ---------------------------------------------------------------------------- streaming
    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        options = self.body.stream_options or p.StreamOptions()
        final: RequestOutput | None = None
        try:
            if self.chat:
                # OpenAI opens every choice with the assistant role.
                yield self._sse(
                    self._chat_chunk(
                        [
                            p.ChatChunkChoice(
                                index=i, delta=p.DeltaMessage(role="assistant", content="")
                            )
                            for i in range(self.body.n)
                        ],
                        None,
                    )
                )
            async for output in stream:
                self._observe(output)
                final = output
                first_chunk_with_prompt_logprobs = output.prompt_logprobs is not None
                for completion in output.outputs:
                    chunk = self._delta_chunk(completion, output, first_chunk_with_prompt_logprobs)
                    if chunk is None:
                        continue
                    first_chunk_with_prompt_logprobs = False
                    if options.include_usage and options.continuous_usage_stats:
                        chunk.usage = self.usage()
                    yield self._sse(chunk)
            if final is not None and final.finished:
                self._finish(final)
            if options.include_usage:
                empty = (
                    self._chat_chunk([], self.usage())
                    if self.chat
                    else self._cmpl_chunk([], self.usage())
                )
                yield self._sse(empty)
        except EngineDeadError as exc:
            error = OpenAIError(str(exc), status_code=503, type="server_error")
            yield f"data: {_json(error.body())}\n\n"
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    def _delta_chunk(
        self, completion: Any, output: RequestOutput, with_prompt_logprobs: bool
    ) -> p.CompletionResponse | p.ChatCompletionChunk | None:
        choice = self.choices[completion.index]
        if choice.finished:
            return None
        text = completion.text[choice.sent_text :]
        new_ids = completion.token_ids[choice.sent_tokens :]
        new_logprobs = (
            None if completion.logprobs is None else completion.logprobs[choice.sent_tokens :]
        )
        finish_reason = completion.finish_reason
        if not text and not new_ids and finish_reason is None:
            return None
        text_offset = choice.sent_text
        choice.sent_text = max(choice.sent_text, len(completion.text))
        choice.sent_tokens = len(completion.token_ids)
        choice.finished = finish_reason is not None
        if self.chat:
            logprobs = None
            if new_logprobs is not None:
                logprobs = self.chat_logprobs(new_ids, new_logprobs)
            return self._chat_chunk(
                [
                    p.ChatChunkChoice(
                        index=completion.index,
                        delta=p.DeltaMessage(content=text),
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                ],
                None,
            )
        logprobs_c = None
        if new_logprobs is not None:
            logprobs_c = self.completion_logprobs(new_ids, new_logprobs, text_offset)
        return self._cmpl_chunk(
            [
                p.CompletionChoice(
                    index=completion.index,
                    text=text,
                    logprobs=logprobs_c,
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(output) if with_prompt_logprobs else None,
                )
            ],
            None,
        )

    def _chat_chunk(
        self, choices: list[p.ChatChunkChoice], usage: p.UsageInfo | None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _cmpl_chunk(
        self, choices: list[p.CompletionChoice], usage: p.UsageInfo | None
    ) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    @staticmethod
    def _sse(chunk: Any) -> str:
        return f"data: {chunk.model_dump_json()}\n\n"


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def _event_json(event: Any) -> dict[str, Any]:
    """A KV-cache event as JSON: its type and fields, hashes as hex."""

    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, list | tuple):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {str(k): convert(v) for k, v in value.items()}
        if isinstance(value, int | float | str | bool) or value is None:
            return value
        return repr(value)

    fields = (
        {f.name: convert(getattr(event, f.name)) for f in dataclasses.fields(event)}
        if dataclasses.is_dataclass(event)
        else {}
    )
    return {"type": type(event).__name__, **fields}
