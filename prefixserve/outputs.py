"""What the engine returns to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: per position, {token_id: Logprob}.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    # "stop" | "length" | "abort" | "error" (see RequestOutput.error) | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # The part of num_cached_tokens loaded from the tiers below the RAM pool (disk and shared:
    # the cache report splits them); the rest came from the RAM pool.
    num_disk_cached_tokens: int = 0
    # Prompt tokens this request wrote to the cache at its breakpoints (Anthropic's
    # cache_creation_input_tokens): past its hit, up to the furthest breakpoint held.
    num_cache_write_tokens: int = 0
    # The same tokens by the ttl (seconds) of the breakpoint they were written for.
    cache_write_tokens_by_ttl: dict[int, int] = field(default_factory=dict)
    finished: bool = False
    # The request's cache report as a dict (docs/cache_reports.md), when its SamplingParams
    # asked for one (`cache_report=True`); set from its first scheduling on.
    cache_report: dict[str, Any] | None = None
    # Set (with finished=True) when this request failed on its own (its seed, non-finite logits,
    # a sampler or detokenizer error): why. The failed sample's finish_reason is "error", its
    # unfinished siblings' "abort". Other requests are not affected.
    error: str | None = None
