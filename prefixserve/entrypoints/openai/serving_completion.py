"""POST /v1/completions: a text or token-id prompt (or prompt embeddings), answered as
`text_completion` objects."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.embeds_wire import decode_prompt_embeds
from prefixserve.entrypoints.openai.serving import (
    Delta,
    ResponseView,
    generate,
    sampling_params,
)
from prefixserve.entrypoints.openai.structured_outputs import structured_outputs_params
from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.models import check_model, lora_request_for
from prefixserve.entrypoints.server.prompts import check_prompt_text, off_loop
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.outputs import Logprob, RequestOutput


async def create_completion(
    state: ServerState, body: p.CompletionRequest, raw: Request, arrival: float
) -> Response:
    model = check_model(state, body.model)
    # Taken now: an adapter unloaded while the prompt is decoded must not turn into the base model.
    lora = lora_request_for(state, model)
    # The constraint's fields, as the engine's errors name them, in this request's words.
    structured, fields = structured_outputs_params(body)
    embeds = None
    if (body.prompt is None) == (body.prompt_embeds is None):
        raise OpenAIError("give exactly one of prompt and prompt_embeds", param="prompt")
    if body.prompt_embeds is not None:
        if not state.engine.enable_prompt_embeds:
            raise OpenAIError(
                "prompt_embeds are not enabled on this server (--enable-prompt-embeds)",
                param="prompt_embeds",
            )
        embeds = await off_loop(state, raw.state.tenant, decode_prompt_embeds, body.prompt_embeds)
        prompt_ids, prompt_text = [], None
    else:
        prompt_ids, prompt_text = await _prompt(state, raw.state.tenant, body)
    params = sampling_params(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        fields=fields,
        structured_outputs=structured,
    )
    view = CompletionView(state, model, body, params.logprobs, arrival)
    return await generate(
        state,
        raw,
        body,
        view,
        prompt_ids,
        params,
        prompt_text=prompt_text,
        fields=fields,
        prompt_embeds=embeds,
        lora_request=lora,
    )


async def _prompt(
    state: ServerState, tenant: str | None, body: p.CompletionRequest
) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text when it came as text. The engine checks the ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        # Checked on the text: a tokenizer that adds a BOS would make "" a one-token prompt.
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        check_prompt_text(state, [prompt], "prompt")
        return await off_loop(state, tenant, state.engine.tokenizer.encode, prompt), prompt
    return list(prompt), None


class CompletionView(ResponseView):
    """Completion responses and chunks (`text_completion` objects, with their logprobs)."""

    id_prefix = "cmpl"

    def logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int
    ) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        offset = text_offset
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            token = self.token_str(token_id, chosen)
            out.tokens.append(token)
            out.token_logprobs.append(None if chosen is None else chosen.logprob)
            top = {self.token_str(t, lp): lp.logprob for t, lp in self.top(entry)}
            if chosen is not None:
                top.setdefault(token, chosen.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def response(self, final: RequestOutput) -> p.CompletionResponse:
        return self._chunk(
            [
                p.CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=None
                    if c.logprobs is None
                    else self.logprobs(c.token_ids, c.logprobs, 0),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(final) if c.index == 0 else None,
                )
                for c in final.outputs
            ],
            self.usage(),
        )

    def delta_chunk(
        self, delta: Delta, output: RequestOutput, with_prompt_logprobs: bool
    ) -> p.CompletionResponse:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = self.logprobs(delta.token_ids, delta.logprobs, delta.text_offset)
        return self._chunk(
            [
                p.CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(output) if with_prompt_logprobs else None,
                )
            ],
            None,
        )

    def usage_chunk(self, usage: p.UsageInfo | None) -> p.CompletionResponse:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list[p.CompletionChoice], usage: p.UsageInfo | None
    ) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
