"""POST /v1/chat/completions: messages rendered with the chat template, answered as
`chat.completion` objects (or `chat.completion.chunk`s, each choice opened with its role)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from prefixserve.entrypoints.chat.tool_parsers.hermes import HermesStreamParser
from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.chat_prompt import ChatPrompt, record_answers, render_chat
from prefixserve.entrypoints.openai.serving import (
    Delta,
    ResponseView,
    generate,
    sampling_params,
)
from prefixserve.entrypoints.openai.serving_tools import (
    StreamedCalls,
    ToolPlan,
    answer_message,
    finish_reason,
    plan_tools,
)
from prefixserve.entrypoints.openai.structured_outputs import structured_outputs_params
from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.models import check_model, lora_request_for
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.outputs import CompletionOutput, Logprob, RequestOutput


async def create_chat_completion(
    state: ServerState, body: p.ChatCompletionRequest, raw: Request, arrival: float
) -> Response:
    model = check_model(state, body.model)
    # Taken now: an adapter unloaded while the prompt is rendered must not turn into the base model.
    lora = lora_request_for(state, model)
    structured, structured_names = structured_outputs_params(body)
    plan = plan_tools(body, state.engine.tokenizer)
    if plan.constraint is not None:
        if structured is not None:
            raise OpenAIError(
                "a tool call cannot also follow response_format or structured_outputs; send "
                'tool_choice "none" with them',
                param="tool_choice",
            )
        structured = plan.constraint
        # A tool's schema the grammar engine refuses is the tools' 400.
        structured_names = {"structured_outputs.grammar": "tools", "structured_outputs": "tools"}
    prompt = await render_chat(state, raw.state.tenant, body, plan)
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
    view = ChatView(state, model, body, params.logprobs, arrival, plan=plan, prompt=prompt)
    return await generate(
        state, raw, body, view, prompt.ids, params, fields=fields, lora_request=lora
    )


class ChatView(ResponseView):
    """Chat responses and chunks (`chat.completion` objects, with their logprobs and tool
    calls)."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        *args: object,
        plan: ToolPlan | None = None,
        prompt: ChatPrompt | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plan = plan or ToolPlan(None, None, None, False, False)
        self.prompt = prompt
        # Calls are held to the format by the call grammar: streamed as they are written.
        early = self.plan.constraint is not None
        self.streamed = [StreamedCalls(HermesStreamParser(early=early)) for _ in range(self.n)]

    def _finish(self, output: RequestOutput | None) -> None:
        super()._finish(output)
        if output is not None and self.prompt is not None:
            record_answers(self.state, self.prompt, output)

    def with_history(self, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """The engine's cache report, with what the history reused: the leading tokens taken
        from this server's earlier answers and the turns it could not reuse
        (`history_rerendered`: message indexes of its answers that rendered to other text)."""
        if report is None or self.prompt is None:
            return report
        rendered = self.prompt.rendered
        return {
            **report,
            "history_reused_tokens": rendered.reused_tokens,
            "history_rerendered": rendered.rerendered,
        }

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
            choices=[self._choice(final, c) for c in final.outputs],
            usage=self.usage(),
        )

    def _choice(self, final: RequestOutput, c: CompletionOutput) -> p.ChatChoice:
        message, has_calls = answer_message(self.plan, c.text)
        return p.ChatChoice(
            index=c.index,
            message=message,
            logprobs=None if c.logprobs is None else self.logprobs(c.token_ids, c.logprobs),
            finish_reason=finish_reason(self.plan, c.finish_reason, has_calls),
            stop_reason=c.stop_reason,
            prompt_logprobs=self.prompt_logprobs(final) if c.index == 0 else None,
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
    ) -> p.ChatCompletionChunk | None:
        # Chat chunks carry no prompt logprobs; the full response has them. Tokens whose text
        # the call parser holds (a "<tool" that may open a call) send no chunk, as OpenAI sends
        # none with an empty delta; they go out with the text that settles them.
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self.logprobs(delta.token_ids, delta.logprobs)
        message = p.DeltaMessage(content=delta.text)
        reason = delta.finish_reason
        if self.plan.parse_calls:
            calls = self.streamed[delta.index]
            message = calls.delta(delta.text, reason is not None)
            reason = finish_reason(self.plan, reason, calls.num_calls > 0)
            if reason is None and logprobs is None and not (message.content or message.tool_calls):
                return None
        return self._chunk(
            [
                p.ChatChunkChoice(
                    index=delta.index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=reason,
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
