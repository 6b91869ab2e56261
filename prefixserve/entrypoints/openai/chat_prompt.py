"""A chat request's prompt: its messages rendered by the chat template (the tool-capable one
when it uses tools), then turned into ids through the tenant's generated history
(entrypoints/chat/history.py: the ids computed for its earlier turns are reused, the rest is
tokenized); and, once it is answered, the answer recorded there for the next turn."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.entrypoints.chat.history import Rendered, assistant_answers
from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.serving_tools import ToolPlan, history_messages
from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.prompts import check_prompt_text, off_loop
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.outputs import RequestOutput


@dataclass(slots=True)
class ChatPrompt:
    """A rendered chat prompt, and what its history reused."""

    tenant: str | None
    text: str = ""
    rendered: Rendered = field(default_factory=lambda: Rendered([], 0, 0, []))
    num_answers: int = 0  # assistant turns in its messages

    @property
    def ids(self) -> list[int]:
        return self.rendered.ids


async def render_chat(
    state: ServerState, tenant: str | None, body: p.ChatCompletionRequest, plan: ToolPlan
) -> ChatPrompt:
    """The messages rendered and tokenized on the tokenizer thread. The engine checks the ids."""
    messages = history_messages(body)
    texts = [m["content"] or "" for m in messages]
    texts += [c["function"]["arguments"] for m in messages for c in m.get("tool_calls", ())]
    check_prompt_text(state, texts, "messages")
    extra: dict[str, object] = {}
    if plan.template is not None:
        extra = {"chat_template": plan.template, "tools": plan.tools}
    tokenizer = state.engine.tokenizer
    answers = assistant_answers(messages)

    def render() -> ChatPrompt:
        try:
            text = tokenizer.apply_chat_template_text(
                messages, add_generation_prompt=body.add_generation_prompt, **extra
            )
        except ValueError:
            raise
        except Exception as exc:  # a template raising on these messages (e.g. role order)
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc

        def encode(part: str) -> list[int]:
            return tokenizer.encode(part, add_special_tokens=False)

        rendered = state.history.tokenize(tenant, text, encode, answers)
        return ChatPrompt(tenant, text, rendered, len(answers))

    try:  # the render bound's 429 (off_loop) is not the messages' fault: it goes out as is
        return await off_loop(state, tenant, render)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="messages") from exc


def record_answers(state: ServerState, prompt: ChatPrompt, final: RequestOutput) -> None:
    """Remember each finished answer's ids for the tenant's next turn (history.record_answer)."""
    eos = state.engine.tokenizer.eos_token_ids
    for completion in final.outputs:
        state.history.record_answer(
            prompt.tenant,
            (prompt.text, final.prompt_token_ids),
            completion,
            eos,
            prompt.num_answers,
        )
