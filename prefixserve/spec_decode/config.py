"""The speculative-decoding option: vLLM's `speculative_config` (a dict, or its JSON string)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
# The most drafts one request may propose a step: each is a row of the verification pass.
MAX_SPECULATIVE_TOKENS = 32
# The longest n-gram the proposer looks up (each token indexes one entry per n-gram length).
MAX_PROMPT_LOOKUP = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """N-gram speculation ("prompt lookup decoding"), with vLLM's field names and defaults.

    Each decode step a request proposes up to `num_speculative_tokens` drafts: the tokens that
    followed the latest earlier occurrence of its last n tokens, for the largest n in
    [`prompt_lookup_min`, `prompt_lookup_max`] that occurs. Unset bounds follow vLLM: both
    unset are 5 and 5; one unset takes the other's value.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_int("prompt_lookup_min", lo, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", hi, MAX_PROMPT_LOOKUP)
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) must be at most "
                f"prompt_lookup_max ({hi})"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)


def _check_int(name: str, value: object, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValueError(
            f"speculative_config {name} must be an integer in [1, {most}], got {value!r}"
        )


def speculative_config_from(
    value: SpeculativeConfig | dict[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """A SpeculativeConfig from what a user gives (`LLM(speculative_config=...)`, the server's
    `--speculative-config` JSON); None stays None (speculation off). A ValueError names an
    unknown key, a bad value or malformed JSON."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    for required in ("method", "num_speculative_tokens"):
        if required not in value:
            raise ValueError(f"speculative_config needs {required} (e.g. {_EXAMPLE})")
    return SpeculativeConfig(**value)
