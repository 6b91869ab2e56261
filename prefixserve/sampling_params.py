"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass(slots=True)
class SamplingParams:
    """How one prompt is sampled. Validated on construction; bad values raise ValueError."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 64:
            raise bad("n", "an integer in [1, 64]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "a positive integer or None")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if len(self._stop_list) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self._stop_list)}"
            )
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad("stop", "non-empty strings")
        if self.prompt_logprobs is not None and self.skip_reading_prefix_cache is False:
            # A prefix hit would leave the hit positions without the logits their logprobs need.
            raise ValueError(
                "prompt_logprobs needs every prompt position computed; it cannot be combined "
                "with skip_reading_prefix_cache=False"
            )
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "non-negative integers")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def skips_prefix_cache_read(self) -> bool:
        """prompt_logprobs need every prompt position's logits: skip the read unless told not to."""
        if self.skip_reading_prefix_cache is not None:
            return self.skip_reading_prefix_cache
        return self.prompt_logprobs is not None
