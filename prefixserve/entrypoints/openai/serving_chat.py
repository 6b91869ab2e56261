"""POST /v1/chat/completions: messages rendered with the chat template, answered as
`chat.completion` objects (or `chat.completion.chunk`s, each choice opened with its role)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.errors import OpenAIError
from prefixserve.entrypoints.openai.models import check_model, lora_request_for
from prefixserve.entrypoints.openai.prompts import check_prompt_text, off_loop
from prefixserve.entrypoints.openai.serving import (
    Delta,
    ResponseView,
    ServerState,
    generate,
    sampling_params,
)
from prefixserve.entrypoints.openai.structured_outputs import structured_outputs_params
from prefixserve.outputs import Logprob, RequestOutput


async def create_chat_completion(
    state: ServerState, body: p.ChatCompletionRequest, raw: Request, arrival: float
) -> Response:
    model = check_model(state, body.model)
    # Taken now: an adapter unloaded while the prompt is rendered must not turn into the base model.
    lora = lora_request_for(state, model)
    structured, structured_names = structured_outputs_params(body)
    prompt_ids = await _prompt(state, raw.state.tenant, body)
    # The fields the engine's errors name, as this endpoint calls them.
    fields = {
        "prompt": "messages",
        "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        **structured_names,
    }
    params = sampling_params(
        body,
        max_tokens=body.effective_max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        fields=fields,
        structured_outputs=structured,
    )
    view = ChatView(state, model, body, params.logprobs, arrival)
    return await generate(
        state, raw, body, view, prompt_ids, params, fields=fields, lora_request=lora
    )


async def _prompt(
    state: ServerState, tenant: str | None, body: p.ChatCompletionRequest
) -> list[int]:
    """The messages rendered by the chat template. The engine checks the ids."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    check_prompt_text(state, [m["content"] for m in messages], "messages")
    try:
        ids = await off_loop(
            state,
            tenant,
            state.engine.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=body.add_generation_prompt,
        )
    except ValueError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    except Exception as exc:  # a template raising on these messages (e.g. role order)
        raise OpenAIError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return list(ids)


class ChatView(ResponseView):
    """Chat responses and chunks (`chat.completion` objects, with their logprobs)."""

    id_prefix = "chatcmpl"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> p.ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            token = self.token_str(token_id, chosen)
            content.append(
                p.ChatTokenLogprob(
                    token=token,
                    logprob=-9999.0 if chosen is None else chosen.logprob,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        p.TopLogprob(
                            token=(s := self.token_str(t, lp)),
                            logprob=lp.logprob,
                            bytes=list(s.encode("utf-8")),
                        )
                        for t, lp in self.top(entry)
                    ],
                )
            )
        return p.ChatLogprobs(content=content)

    def response(self, final: RequestOutput) -> p.ChatCompletionResponse:
        return p.ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                p.ChatChoice(
                    index=c.index,
                    message=p.ChatMessageOut(content=c.text),
                    logprobs=None if c.logprobs is None else self.logprobs(c.token_ids, c.logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(final) if c.index == 0 else None,
                )
                for c in final.outputs
            ],
            usage=self.usage(),
        )

    def opening_chunks(self) -> list[p.ChatCompletionChunk]:
        # OpenAI opens every choice with the assistant role.
        return [
            self._chunk(
                [
                    p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                    for i in range(self.n)
                ],
                None,
            )
        ]

    def delta_chunk(
        self, delta: Delta, output: RequestOutput, with_prompt_logprobs: bool
    ) -> p.ChatCompletionChunk:
        # Chat chunks carry no prompt logprobs; the full response has them.
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self.logprobs(delta.token_ids, delta.logprobs)
        return self._chunk(
            [
                p.ChatChunkChoice(
                    index=delta.index,
                    delta=p.DeltaMessage(content=delta.text),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
            ],
            None,
        )

    def usage_chunk(self, usage: p.UsageInfo | None) -> p.ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list[p.ChatChunkChoice], usage: p.UsageInfo | None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
