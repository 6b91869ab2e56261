"""The generation plumbing the completions and chat endpoints share.

An endpoint (serving_completion.py, serving_chat.py) turns its body into prompt token ids, the
SamplingParams (`sampling_params`) and a `ResponseView` subclass, then calls `generate`: derive the
cache salt, admit the request and add it to the engine (the shell's `server/state.py`
`start_request`, whose errors are 400s, 429s and 503s before any header is sent), and answer with
an SSE stream or one JSON response. The view keeps what every response needs (usage, cached
tokens, latency metrics, what was already streamed); subclasses only shape the objects.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import Response

from prefixserve.core.kv_cache.salts import derive_cache_salt
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.exceptions import EngineDeadError, StreamStalledError
from prefixserve.engine.request_stream import RequestStream
from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.server.errors import (
    OpenAIError,
    engine_stopped,
    from_value_error,
    request_failed,
)
from prefixserve.entrypoints.server.metrics import RequestTimer
from prefixserve.entrypoints.server.state import (
    ServerState,
    collect_response,
    final_output,
    start_request,
    stream_response,
)
from prefixserve.lora.config import LoRARequest
from prefixserve.outputs import CompletionOutput, Logprob, RequestOutput
from prefixserve.sampling_params import SamplingParams, StructuredOutputsParams

AnyRequest = p.CompletionRequest | p.ChatCompletionRequest
# A streamed chunk: both kinds carry `usage`.
Chunk = p.CompletionResponse | p.ChatCompletionChunk


def sampling_params(
    body: AnyRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    fields: Mapping[str, str] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from the fields both endpoints share; `max_tokens` and `logprobs` are
    the endpoint's own reading of its body, `structured_outputs` its constraint
    (structured_outputs.py). `fields` renames the error's param (see errors.py)."""
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
            cache_report=body.cache_report,
            structured_outputs=structured_outputs,
        )
    except ValueError as exc:
        raise from_value_error(exc, fields) from exc


async def generate(
    state: ServerState,
    raw: Request,
    body: AnyRequest,
    view: ResponseView,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    prompt_text: str | None = None,
    fields: Mapping[str, str] | None = None,
    prompt_embeds: Any = None,
    lora_request: LoRARequest | None = None,
) -> Response:
    """Run one request through the engine and answer it as `view` shapes it (with the LoRA
    adapter its `model` named when it was checked; `prompt_embeds` instead of `prompt_ids`)."""
    cache_salt = derive_cache_salt(raw.state.tenant, body.cache_salt)
    num_prompt = len(prompt_ids) if prompt_embeds is None else prompt_embeds.shape[0]
    request = EngineRequest(
        view.request_id,
        prompt_ids,
        params,
        cache_salt=cache_salt,
        prompt=prompt_text,
        tenant=raw.state.tenant,
        cache_retention=body.prompt_cache_retention,
        prompt_cache_key=body.prompt_cache_key,
        lora_request=lora_request,
        prompt_embeds=prompt_embeds,
        final_only=not body.stream,  # replicas may start it over unseen if one dies
    )
    stream, ticket = await start_request(state, raw, request, num_prompt, fields)
    if body.stream:
        return stream_response(state, view.stream(stream), ticket)
    return await collect_response(state, raw, view.collect(stream), stream, ticket)


@dataclass(slots=True)
class _ChoiceState:
    sent_text: int = 0  # characters of text already streamed
    sent_tokens: int = 0  # token ids (and logprobs) already streamed
    num_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class Delta:
    """What one choice gained since its last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text_offset: int  # characters of the choice's text sent before this delta
    finish_reason: str | None
    stop_reason: int | str | None


class ResponseView(ABC):
    """Turns one request's cumulative RequestOutputs into an OpenAI response or SSE chunks.

    Subclasses name the id prefix and build the endpoint's objects: `response` (non-streaming),
    `delta_chunk` (one choice's new text), `usage_chunk` (the final usage-only chunk) and
    `opening_chunks` (sent before any token).
    """

    id_prefix: ClassVar[str]

    def __init__(
        self,
        state: ServerState,
        model: str,
        body: AnyRequest,
        num_logprobs: int | None,
        arrival: float,
    ) -> None:
        self.state = state
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.n = body.n
        self.stream_options = body.stream_options or p.StreamOptions()
        self.num_logprobs = num_logprobs
        self.timer = RequestTimer(state.metrics, arrival)
        self.created = int(time.time())
        self.choices = [_ChoiceState() for _ in range(body.n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._token_text: dict[int, str] = {}

    # ---------------------------------------------------------------- what subclasses shape
    @abstractmethod
    def response(self, final: RequestOutput) -> p.CompletionResponse | p.ChatCompletionResponse:
        """The whole response of a finished request."""

    @abstractmethod
    def delta_chunk(
        self, delta: Delta, output: RequestOutput, with_prompt_logprobs: bool
    ) -> Chunk | None:
        """The chunk streaming `delta`; `with_prompt_logprobs` on the request's first chunk.
        None when it carries nothing yet (text a tool-call parser holds back)."""

    @abstractmethod
    def usage_chunk(self, usage: p.UsageInfo | None) -> Chunk:
        """The chunk without choices that carries the final usage (and the cache report)."""

    def opening_chunks(self) -> list[Chunk]:
        """Chunks sent before the first token."""
        return []

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

    # ------------------------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        """The text of one token: the engine's decoding when it gave one, else decoded here."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._token_text.get(token_id)
        if text is None:
            text = self.state.engine.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def top(self, entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
        """The request's `num_logprobs` best-ranked alternatives of one position, best first."""
        k = self.num_logprobs or 0
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)
        return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]

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
                    logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_str(t, lp)
                )
                for t, lp in entry.items()
            }
            for entry in output.prompt_logprobs
        ]

    def with_history(self, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """The cache report as the client gets it (chat adds what its history reused)."""
        return report

    # ------------------------------------------------------------------------ non-streaming
    async def collect(self, stream: RequestStream) -> dict[str, Any]:
        final = await final_output(stream, self._observe)
        self._finish(final)
        body = self.response(final).model_dump(mode="json")
        report = self.with_history(final.cache_report)
        if report is not None:
            body["cache_report"] = report
        return body

    # ---------------------------------------------------------------------------- streaming
    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        options = self.stream_options
        final: RequestOutput | None = None
        try:
            for chunk in self.opening_chunks():
                yield _sse(chunk)
            async for output in stream:
                if output.error is not None:
                    yield _sse_error(request_failed(output.error))
                    yield "data: [DONE]\n\n"
                    return
                self._observe(output)
                final = output
                with_prompt_logprobs = output.prompt_logprobs is not None
                for completion in output.outputs:
                    delta = self._take_delta(completion)
                    if delta is None:
                        continue
                    chunk = self.delta_chunk(delta, output, with_prompt_logprobs)
                    if chunk is None:
                        continue
                    with_prompt_logprobs = False
                    if options.include_usage and options.continuous_usage_stats:
                        chunk.usage = self.usage()
                    yield _sse(chunk)
            if final is not None and final.finished:
                self._finish(final)
            report = self.with_history(final.cache_report if final is not None else None)
            if options.include_usage or report is not None:
                usage = self.usage() if options.include_usage else None
                yield _sse(
                    self.usage_chunk(usage), None if report is None else {"cache_report": report}
                )
        except EngineDeadError:
            yield _sse_error(engine_stopped())
        except StreamStalledError:
            return  # nobody has read this stream for the stall timeout: nothing more to send
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    def _take_delta(self, completion: CompletionOutput) -> Delta | None:
        """What `completion` adds to its choice since the last chunk (None: nothing new)."""
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
        return Delta(
            index=completion.index,
            text=text,
            token_ids=new_ids,
            logprobs=new_logprobs,
            text_offset=text_offset,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        )


def _sse(chunk: Chunk, extra: dict[str, Any] | None = None) -> str:
    if extra is None:
        return f"data: {chunk.model_dump_json()}\n\n"
    return f"data: {json.dumps({**chunk.model_dump(mode='json'), **extra})}\n\n"


def _sse_error(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
