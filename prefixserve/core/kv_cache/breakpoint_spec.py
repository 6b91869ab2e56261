"""What a client asks to keep: cache breakpoints (Anthropic's `cache_control`, OpenAI's
`prompt_cache_retention: "24h"`), checked; and what became of each (`HoldStatus`). Plain records
that `Request` carries; `breakpoints.py` holds them in the pool."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Anthropic's `cache_control.ttl` values, and OpenAI's extended retention.
TTL_SECONDS: dict[str, int] = {"5m": 300, "1h": 3600, "24h": 86400}
# Anthropic allows at most this many `cache_control` breakpoints in one request.
MAX_BREAKPOINTS = 4


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """Keep the prompt's first `num_tokens` tokens (its full blocks) for `ttl_s` seconds after
    their last use."""

    num_tokens: int
    ttl_s: int


class HoldStatus(enum.StrEnum):
    """What became of one breakpoint of a request."""

    HELD = "held"  # newly held: this request wrote it
    REFRESHED = "refreshed"  # held already (by an earlier request): its expiry moved on
    REFUSED_BUDGET = "refused_budget"  # past the tenant's budget or the shared capacity
    REFUSED_POOL = "refused_pool"  # would leave a queued request without room
    NOT_CACHED = "not_cached"  # shorter than a block, or its blocks are not cached


def check_breakpoints(breakpoints: object, num_prompt_tokens: int) -> None:
    """Raise ValueError naming the problem: not CacheBreakpoints, more than MAX_BREAKPOINTS,
    positions not increasing within the prompt, an unknown TTL, or a longer TTL after a shorter
    one (Anthropic's rule: a later breakpoint must not outlive an earlier one)."""
    if not isinstance(breakpoints, tuple | list):
        raise ValueError(
            f"cache_breakpoints must be a tuple of CacheBreakpoint, got {breakpoints!r}"
        )
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise ValueError(
            f"at most {MAX_BREAKPOINTS} cache breakpoints per request, got {len(breakpoints)}"
        )
    previous: CacheBreakpoint | None = None
    allowed = sorted(set(TTL_SECONDS.values()))
    for bp in breakpoints:
        if not isinstance(bp, CacheBreakpoint):
            raise ValueError(f"a cache breakpoint must be a CacheBreakpoint, got {bp!r}")
        if isinstance(bp.num_tokens, bool) or not isinstance(bp.num_tokens, int):
            raise ValueError(
                f"a cache breakpoint's num_tokens must be an int, got {bp.num_tokens!r}"
            )
        if not 0 <= bp.num_tokens <= num_prompt_tokens:
            raise ValueError(
                f"a cache breakpoint at token {bp.num_tokens} is outside the prompt's "
                f"{num_prompt_tokens} tokens"
            )
        if bp.ttl_s not in allowed:
            raise ValueError(
                f"a cache breakpoint's ttl_s must be one of {allowed}, got {bp.ttl_s!r}"
            )
        if previous is not None and bp.num_tokens < previous.num_tokens:
            raise ValueError("cache breakpoints must come in prompt order")
        if previous is not None and bp.ttl_s > previous.ttl_s:
            raise ValueError(
                "a cache breakpoint with a longer ttl cannot come after one with a shorter ttl"
            )
        previous = bp


def request_breakpoints(
    breakpoints: object, cache_retention: str | None, num_prompt_tokens: int
) -> tuple[CacheBreakpoint, ...]:
    """A request's checked breakpoints; OpenAI's `prompt_cache_retention: "24h"` without any
    is one breakpoint at the prompt's end, kept for 24 hours."""
    check_breakpoints(breakpoints, num_prompt_tokens)
    assert isinstance(breakpoints, tuple | list)
    if not breakpoints and cache_retention == "24h":
        return (CacheBreakpoint(num_prompt_tokens, TTL_SECONDS["24h"]),)
    return tuple(breakpoints)
