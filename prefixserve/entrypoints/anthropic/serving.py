"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the same
engine client, tenants, admission and metrics as the OpenAI routes.

One request's path: the request guard (a tenant key as `x-api-key` or a bearer token) -> the body
(protocol.py) -> its tools' constraint (tools.py: the call grammar) -> the prompt and its
breakpoints (render.py, on the tokenizer thread) -> an `EngineRequest` with the tenant's cache
salt and the breakpoints -> one `message` object (text and `tool_use` blocks), or Anthropic's
server-sent events (`message_start` ... `message_stop`). The usage splits the prompt
as Anthropic does: `cache_read_input_tokens` (read from the cache), `cache_creation_input_tokens`
(written at the request's breakpoints) and `input_tokens` (the rest).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.core.kv_cache.salts import derive_cache_salt
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.exceptions import EngineDeadError, StreamStalledError
from prefixserve.engine.request_stream import RequestStream
from prefixserve.entrypoints.anthropic import protocol as a
from prefixserve.entrypoints.anthropic.render import Rendered, RenderError, render
from prefixserve.entrypoints.anthropic.tools import (
    GRAMMAR_FIELDS,
    NO_TOOLS,
    StreamedBlocks,
    ToolPlan,
    answer_content,
    check_tool_request,
    plan_tools,
    stop_reason,
    tool_texts,
)
from prefixserve.entrypoints.chat.tool_parsers.hermes import HermesStreamParser
from prefixserve.entrypoints.server.error_shape import anthropic_error_body
from prefixserve.entrypoints.server.errors import (
    OpenAIError,
    engine_stopped,
    from_value_error,
    request_failed,
)
from prefixserve.entrypoints.server.metrics import RequestTimer
from prefixserve.entrypoints.server.models import check_model, lora_request_for
from prefixserve.entrypoints.server.prompts import check_prompt_text, off_loop
from prefixserve.entrypoints.server.state import (
    ServerState,
    collect_response,
    final_output,
    server_state,
    start_request,
    stream_response,
)
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling_params import SamplingParams, StructuredOutputsParams

# What the engine's errors call a field, as this API calls it.
FIELDS = {"prompt": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences"}


router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: a.MessagesRequest, raw: Request) -> Response:
    return await _create_message(server_state(raw), body, raw, time.monotonic())


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: a.CountTokensRequest, raw: Request) -> JSONResponse:
    state = server_state(raw)
    check_model(state, body.model)
    check_tool_request(body)
    rendered = await _render(state, raw.state.tenant, body)
    return JSONResponse({"input_tokens": len(rendered.token_ids)})


async def _render(state: ServerState, tenant: str | None, body: a._PromptFields) -> Rendered:
    """The prompt of `body`, rendered in `tenant`'s turn on the tokenizer thread (a 429 past
    its bound of jobs there: prompts.off_loop)."""
    texts = [b.text for b in body.system_blocks()]
    texts += [b.text for m in body.messages for b in m.text_blocks()]
    texts += tool_texts(body)
    check_prompt_text(state, texts, "messages")
    try:
        history = functools.partial(state.history.prefix, tenant)
        return await off_loop(state, tenant, render, state.engine.tokenizer, body, history)
    except RenderError as exc:
        raise OpenAIError(str(exc), param="messages") from exc


async def _create_message(
    state: ServerState, body: a.MessagesRequest, raw: Request, arrival: float
) -> Response:
    model = check_model(state, body.model)
    lora = lora_request_for(state, model)
    plan = plan_tools(body)
    fields = FIELDS if plan.constraint is None else {**FIELDS, **GRAMMAR_FIELDS}
    rendered = await _render(state, raw.state.tenant, body)
    params = _sampling_params(body, plan.constraint, fields)
    view = MessageView(state, model, body, arrival, plan, (raw.state.tenant, rendered))
    request = EngineRequest(
        view.message_id,
        rendered.token_ids,
        params,
        cache_salt=derive_cache_salt(raw.state.tenant, None),
        prompt=rendered.text,
        tenant=raw.state.tenant,
        lora_request=lora,
        final_only=not body.stream,
        cache_breakpoints=rendered.breakpoints,
    )
    stream, ticket = await start_request(state, raw, request, len(rendered.token_ids), fields)
    if body.stream:
        return stream_response(state, view.events(stream), ticket)
    return await collect_response(state, raw, view.collect(stream), stream, ticket)


def _sampling_params(
    body: a.MessagesRequest,
    constraint: StructuredOutputsParams | None,
    fields: dict[str, str],
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            stop=body.stop_sequences,
            cache_report=body.cache_report,
            structured_outputs=constraint,
        )
    except ValueError as exc:
        raise from_value_error(exc, fields) from exc


def usage_of(output: RequestOutput, num_output_tokens: int) -> a.Usage:
    """Anthropic's usage of one output: read + written + the rest = the prompt's tokens."""
    num_prompt = len(output.prompt_token_ids)
    read = output.num_cached_tokens
    written = output.num_cache_write_tokens
    by_ttl = output.cache_write_tokens_by_ttl
    return a.Usage(
        input_tokens=num_prompt - read - written,
        output_tokens=num_output_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=read,
        cache_creation=a.CacheCreation(
            ephemeral_5m_input_tokens=by_ttl.get(300, 0),
            ephemeral_1h_input_tokens=by_ttl.get(3600, 0) + by_ttl.get(86400, 0),
        ),
    )


def stop_reason_of(completion: CompletionOutput) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if completion.finish_reason == "stop":
        if isinstance(completion.stop_reason, str):
            return "stop_sequence", completion.stop_reason
        return "end_turn", None
    return None, None


def _stop(completion: CompletionOutput, has_calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence), `tool_use` for an answer that ended with calls."""
    reason, stop_sequence = stop_reason_of(completion)
    if stop_reason(reason, has_calls) == "tool_use":
        return "tool_use", None
    return reason, stop_sequence


class MessageView:
    """One request's outputs as a `message` object or as Anthropic's event stream."""

    def __init__(
        self,
        state: ServerState,
        model: str,
        body: a.MessagesRequest,
        arrival: float,
        plan: ToolPlan = NO_TOOLS,
        prompt: tuple[str | None, Rendered] | None = None,
    ) -> None:
        """`prompt`: the tenant and its rendered prompt, whose answer the tenant's history
        records for its next turn (entrypoints/chat/history.py)."""
        self.state = state
        self.model = model
        self.plan = plan
        self.prompt = prompt
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.timer = RequestTimer(state.metrics, arrival)
        # Calls are held to the format by the call grammar: streamed as they are written.
        parser = HermesStreamParser(early=True) if plan.parse_calls else None
        self.blocks = StreamedBlocks(parser)

    def _observe(self, output: RequestOutput) -> CompletionOutput:
        completion = output.outputs[0]
        self.timer.on_tokens(time.monotonic(), len(completion.token_ids))
        return completion

    def _finish(self, output: RequestOutput) -> None:
        self.timer.on_finish(time.monotonic(), [c.finish_reason for c in output.outputs])
        metrics = self.state.metrics
        metrics.cached_prompt_tokens.inc(output.num_cached_tokens)
        metrics.cache_write_prompt_tokens.inc(output.num_cache_write_tokens)
        if self.prompt is not None:
            tenant, rendered = self.prompt
            self.state.history.record_answer(
                tenant,
                (rendered.text, output.prompt_token_ids),
                output.outputs[0],
                self.state.engine.tokenizer.eos_token_ids,
                rendered.num_answers,
            )

    def cache_report(self, final: RequestOutput) -> dict[str, Any] | None:
        """The engine's cache report, with what the history reused (as the chat route's:
        `history_reused_tokens`, and `history_rerendered` by message index of the prompt as the
        template reads it, tool results being messages of their own)."""
        report = final.cache_report
        if report is None or self.prompt is None:
            return report
        found = self.prompt[1].history
        return {
            **report,
            "history_reused_tokens": len(found.ids),
            "history_rerendered": found.rerendered,
        }

    # ------------------------------------------------------------------------ non-streaming
    async def collect(self, stream: RequestStream) -> dict[str, Any]:
        final = await final_output(stream, self._observe)
        self._finish(final)
        completion = final.outputs[0]
        content, has_calls = answer_content(self.plan, completion.text)
        reason, stop_sequence = _stop(completion, has_calls)
        body = a.MessageResponse(
            id=self.message_id,
            model=self.model,
            content=content,
            stop_reason=reason,
            stop_sequence=stop_sequence,
            usage=usage_of(final, len(completion.token_ids)),
        ).model_dump(mode="json")
        if final.cache_report is not None:
            body["cache_report"] = self.cache_report(final)
        return body

    # ---------------------------------------------------------------------------- streaming
    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """message_start (with the prompt's usage, once the prompt is computed), ping, and
        the content blocks' events (StreamedBlocks: a text-only answer's one text block opens
        before the ping), message_delta (stop reason, output tokens), message_stop; an `error`
        event instead when the request or the engine fails."""
        sent = 0
        final: RequestOutput | None = None
        try:
            async for output in stream:
                if output.error is not None:
                    message = request_failed(output.error).message
                    yield _event("error", anthropic_error_body(500, message))
                    return
                completion = self._observe(output)
                if final is None:
                    for name, data in self._opening(output):
                        yield _event(name, data)
                final = output
                if len(completion.text) > sent:
                    piece, sent = completion.text[sent:], len(completion.text)
                    for name, data in self.blocks.feed(piece):
                        yield _event(name, data)
            if final is None or not final.finished:
                return
            for name, data in self.blocks.finish():
                yield _event(name, data)
            self._finish(final)
            for name, data in self._closing(final):
                yield _event(name, data)
        except EngineDeadError:
            yield _event("error", anthropic_error_body(503, engine_stopped().message))
        except StreamStalledError:
            return  # nobody has read this stream for the stall timeout
        finally:
            stream.abort()

    def _opening(self, first: RequestOutput) -> list[tuple[str, dict[str, Any]]]:
        usage = usage_of(first, 0).model_dump(mode="json")
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [
            ("message_start", {"type": "message_start", "message": message}),
            *self.blocks.opening(),
            ("ping", {"type": "ping"}),
        ]

    def _closing(self, final: RequestOutput) -> list[tuple[str, dict[str, Any]]]:
        completion = final.outputs[0]
        reason, stop_sequence = _stop(completion, self.blocks.num_calls > 0)
        usage = usage_of(final, len(completion.token_ids)).model_dump(mode="json")
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
            "usage": usage,
        }
        if final.cache_report is not None:
            delta["cache_report"] = self.cache_report(final)
        return [
            ("message_delta", delta),
            ("message_stop", {"type": "message_stop"}),
        ]


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
