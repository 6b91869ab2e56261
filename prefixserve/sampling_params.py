"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

The bounds below are the one definition of what a request may ask for; the server's
protocol models (entrypoints/openai/protocol.py) import them, so the offline API refuses what the
server refuses.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1
# Child i of a request with n > 1 samples with seed + i, which must fit 64 bits.
MAX_SEED = 2**64 - 1
TEMPERATURE_RANGE = (0.0, 100.0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
# Structured outputs: the largest schema, regex or grammar (characters, a schema serialized
# compactly), the most `choice` strings and the longest `whitespace_pattern`.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_WHITESPACE_PATTERN_CHARS = 256

# The deepest a JSON Schema may nest (objects and arrays inside each other). Checking a schema
# recurses once per level (jsonschema, then the grammar compiler), so a deeper one would exhaust
# Python's recursion limit; real schemas nest a few levels and put shared parts in `$defs`.
MAX_SCHEMA_DEPTH = 64

# The kinds of constraint a StructuredOutputsParams carries, exactly one per request.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def check_text(text: str) -> str:
    """`text` when it is valid Unicode (no lone surrogate, which JSON can carry), else
    ValueError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: {exc.reason} at character {exc.start}") from None
    return text


def check_schema(schema: Any) -> Any:
    """`schema` when it nests at most MAX_SCHEMA_DEPTH objects and arrays deep (walked with a
    stack, never recursion) and all its text is valid Unicode, else ValueError."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            check_text(value)
            continue
        if isinstance(value, dict):
            for key in value:
                check_text(key)
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays")
        stack.extend((child, depth + 1) for child in children)
    return schema


def schema_from_text(text: str, what: str = "structured_outputs.json") -> Any:
    """A schema given as JSON text, parsed within the bounds (ValueError naming `what` and what
    is wrong with it)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{what} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are allowed"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(
            f"{what} nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the answer must match (vLLM's `StructuredOutputsParams`): exactly one of
    `json` (a JSON Schema, as a dict or its JSON text), `regex`, `choice` (one of these strings),
    `grammar` (a Lark grammar as llguidance reads it, or llama.cpp's GBNF) or `json_object=True`
    (any JSON object).
    `whitespace_pattern` (a regex) is the whitespace a JSON answer may put between its tokens;
    by default it puts none (compact JSON: small models otherwise pad with whitespace).
    Validated on construction (shape and size only; the grammar compiles in the engine)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        if isinstance(self.json, str):
            self.json = schema_from_text(self.json)
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON Schema object")
        try:  # before anything recurses over it or encodes it
            for name in (*STRUCTURED_KINDS, "whitespace_pattern"):
                check_schema(getattr(self, name))
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{given[0]}: {exc}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be true or false")
        self._check_choice()
        pattern = self.whitespace_pattern
        if pattern is not None and (
            not isinstance(pattern, str) or len(pattern) > MAX_WHITESPACE_PATTERN_CHARS
        ):
            raise ValueError(
                "structured_outputs.whitespace_pattern must be a string of at most "
                f"{MAX_WHITESPACE_PATTERN_CHARS} characters"
            )
        size = len(self.canonical())
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs.{given[0]} is {size} characters; at most "
                f"{MAX_GRAMMAR_CHARS} are allowed"
            )

    def _check_choice(self) -> None:
        if self.choice is None:
            return
        if (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or len(self.choice) > MAX_CHOICES
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be 1 to {MAX_CHOICES} non-empty strings"
            )
        self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def canonical(self) -> str:
        """One text per constraint, whatever the key order of its schema: what the engine's
        grammar cache is keyed by (with the tokenizer and the tenant)."""
        return json.dumps(
            {"kind": self.kind, "value": getattr(self, self.kind), "ws": self.whitespace_pattern},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )


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
    # Return the request's cache report (`RequestOutput.cache_report`, docs/cache_reports.md).
    cache_report: bool = False
    # Constrain the answer to a schema, regex, choice or grammar (structured_output/).
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:  # noqa: C901 - a flat list of independent field checks, one branch each
        def bad(name: str, allowed: str) -> ValueError:
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return ValueError(f"{name} must be {allowed}, got {shown}")

        def in_range(name: str, low: float, high: float, *, low_open: bool = False) -> None:
            value = getattr(self, name)
            ok = (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and (low < value if low_open else low <= value)
                and value <= high
            )
            if not ok:
                raise bad(name, f"a finite number in {'(' if low_open else '['}{low}, {high}]")

        if not isinstance(self.n, int) or self.n < 1 or self.n > MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "a positive integer or None")
        in_range("temperature", *TEMPERATURE_RANGE)
        in_range("top_p", 0.0, 1.0, low_open=True)
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"an integer in [-1, {MAX_TOP_K}] (0 or -1 disables it)")
        in_range("min_p", 0.0, 1.0)
        in_range("presence_penalty", *PENALTY_RANGE)
        in_range("frequency_penalty", *PENALTY_RANGE)
        in_range("repetition_penalty", *REPETITION_PENALTY_RANGE)
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not 0 <= self.seed <= MAX_SEED - (self.n - 1)
        ):
            raise bad("seed", f"None or an integer in [0, 2**64 - n] (n={self.n})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.cache_report, bool):
            raise bad("cache_report", "true or false")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "None or a StructuredOutputsParams")
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
        if any(
            not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS
            for s in self._stop_list
        ):
            raise bad("stop", f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if self.prompt_logprobs is not None and self.skip_reading_prefix_cache is False:
            # A prefix hit would leave the hit positions without the logits their logprobs need.
            raise ValueError(
                "prompt_logprobs needs every prompt position computed; it cannot be combined "
                "with skip_reading_prefix_cache=False"
            )
        if self.stop_token_ids is not None and (
            len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
            or any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID
                for t in self.stop_token_ids
            )
        ):
            raise bad(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} integers in [0, {MAX_TOKEN_ID}]",
            )

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
