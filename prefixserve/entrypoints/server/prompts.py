"""What is done to a prompt's text before the engine sees it, off the event loop where it costs.

A text prompt is checked on its characters first (a lone surrogate; more characters than any
legal prompt can have), then tokenized (or rendered with the chat template) on the app's
tokenizer thread, so a long prompt never stalls the event loop that serves everyone else; that
thread takes the tenants' jobs in turn, and each tenant may have a bounded number there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.state import ServerState

T = TypeVar("T")

# No token of a tokenizer this server loads decodes to more characters than this, so a prompt
# longer than max_model_len * MAX_CHARS_PER_TOKEN characters cannot fit the context and is
# refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


def check_prompt_text(state: ServerState, texts: list[str], param: str) -> None:
    """Refuse text that cannot be a legal prompt, before it is tokenized: a lone surrogate (not
    UTF-8), or more than max_model_len * MAX_CHARS_PER_TOKEN characters (a 400
    context_length_exceeded, as the engine answers a too-long prompt)."""
    limit = state.engine.max_model_len * MAX_CHARS_PER_TOKEN
    num_chars = sum(len(t) for t in texts)
    if num_chars > limit:
        raise OpenAIError(
            f"the prompt has {num_chars} characters; at most {MAX_CHARS_PER_TOKEN} per token "
            f"of max_model_len {state.engine.max_model_len} ({limit}) can fit the context",
            param=param,
            code="context_length_exceeded",
        )
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(
                f"{param} is not valid Unicode text: {exc.reason} at character {exc.start}",
                param=param,
            ) from exc


async def off_loop(
    state: ServerState, tenant: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """`fn(*args, **kwargs)` on the tokenizer thread, so the event loop goes on serving, in
    `tenant`'s turn (tokenizer_queue.py). A 429 when `tenant` already has its bound of jobs
    there (`--max-render-jobs-per-tenant`)."""
    state.admission.admit_render(tenant)
    try:
        return await state.tokenizer_queue.run(tenant, functools.partial(fn, *args, **kwargs))
    finally:
        state.admission.release_render(tenant)
