"""The records a benchmark workload is made of (shared by the pool-made and the text-made
workloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload.

    `after` names the request that must finish before this one is sent (the previous turn of a
    W2 conversation); `group` names what it shares a prefix with (a W1 system prompt, a W2
    conversation, a W3 document), or is None; `tenant` (W8) is sent as the request's
    `cache_salt`, so each tenant caches apart as under its own API key.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None
    after: str | None = None
    group: str | None = None
    tenant: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    requests: list[BenchRequest] = field(default_factory=list)
    seed: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """What a workload made of text (W7) needs of the model's tokenizer.

    `encode`: text -> token ids, no special tokens added. `chat`: one user message -> the ids of
    a whole prompt (the chat template's turn markers around it and the assistant's generation
    prompt; a model without a template gets the text and a blank line), less the special
    tokens its tokenizer puts before any text (`load_token_pool`'s special prefix), which
    `prepend_tokens` adds back to token-id prompts and text-taking servers add themselves.
    """

    encode: Callable[[str], list[int]]
    chat: Callable[[str], list[int]]


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))
