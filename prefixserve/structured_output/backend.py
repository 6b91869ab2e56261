"""The grammar backend: llguidance (https://github.com/guidance-ai/llguidance).

Why llguidance and not xgrammar (docs/structured_outputs.md says the same at more length):
- compile time is a few milliseconds for the schemas agents send (an Earley parser over a lazy
  lexer: nothing is precomputed over the vocabulary per grammar), so a request barely waits
  and a tenant's thousand distinct schemas cost milliseconds each, not seconds;
- a mask is ~10-50 us per token on a 49k vocabulary, computed with the GIL released, so it
  overlaps the forward pass on the second core;
- it exposes the forced ("fast-forward") tokens of a state in the tokenizer's canonical
  tokenization (`compute_ff_tokens`), which is what jump-forward needs;
- it is a Rust wheel with no dependency (xgrammar pins torch builds and ships its own CUDA
  kernels), and it reads JSON Schema, regexes and Lark grammars through one entry point;
- its parser limits (`LLParserLimits`) bound every compile and parser step, so a hostile grammar
  fails its own request instead of stalling the step (request_state.py adds a time budget per
  token as a backstop).
Everything llguidance-specific lives in this module; the rest of the room sees `CompiledGrammar`
and `GrammarMatcher`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

import llguidance
import numpy as np

from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.errors import GrammarError

# Bounds on one grammar's compile and on each parser step (llguidance's "fuel"), below the
# library's defaults. Measured on the default model's tokenizer (one Xeon core): the 55 schemas
# of benchmarks/structured/schemas.py compile in at most 28 ms, a 1,000-value enum, 1,024
# choices and 300 required properties work; the largest schema the size bound lets through (a
# 270 KB anyOf of 380 objects) compiles in 1.7 s; an ambiguous grammar built to blow up
# (`s: s s s | s s | "a"`) fails its request within 25 tokens at under 1 ms a mask (with the
# library's defaults: 1.5 s a mask by 400 tokens, the step waiting on it).
_LIMITS = dict(
    max_items_in_row=200,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=10_000,
    max_lexer_states=100_000,
    max_grammar_size=50_000,
    verbose_errors=False,  # errors go back to clients: never another request's grammar state
)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**_LIMITS)


def mask_words(vocab_size: int) -> int:
    """32-bit words in one token bitmask row."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's position in its grammar: what it may emit next, and what it emitted."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def consume(self, token_ids: Iterable[int]) -> bool:
        """Advance over tokens the request emitted; False when one is not allowed (the matcher
        is then in its error state)."""
        return bool(self._matcher.consume_tokens(list(token_ids)))

    def num_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows from here (state kept)."""
        if not token_ids:
            return 0
        return int(self._matcher.validate_tokens(token_ids))

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, in the tokenizer's canonical tokenization (empty when
        the model has a choice)."""
        return list(self._matcher.compute_ff_tokens())

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask of the current state into `row` (int32, C order)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (not even whitespace)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class CompiledGrammar:
    """A compiled grammar: matchers for new requests are copies of its start state."""

    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    """Compiles StructuredOutputsParams for one tokenizer (a Hugging Face fast tokenizer)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        # The engine's end tokens (a chat model's end of turn among them) end a grammar's answer.
        self._eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on the first compile (~0.3 s on the compile
        thread; an engine that never sees a grammar never pays it)."""
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer_json(self._hf_tokenizer),
                n_vocab=self.vocab_size,
                eos_token=self._eos_token_ids,
            )
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`, or GrammarError naming what is wrong with it."""
        text = grammar_text(params)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise _refusal(params, matcher.get_error())
        return CompiledGrammar(matcher)


def tokenizer_json(hf_tokenizer: Any) -> str:
    """The fast tokenizer's JSON as llguidance should read it. A byte-level BPE whose decoder is
    a Sequence around its ByteLevel step (as GGUF conversions write them: ByteFallback, Fuse,
    Replace, ByteLevel) is given its plain ByteLevel decoder: llguidance tells a byte-level
    vocabulary by its decoder's type, and would otherwise take "Ġ" and "Ċ" for the UTF-8 of those
    letters rather than a space and a newline, so the grammar would see other bytes than the
    client (`test_the_grammar_sees_the_bytes_the_client_sees`)."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return json.dumps(spec)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (JSON Schemas checked against their metaschema)."""
    options: dict[str, Any] = {"whitespace_flexible": False}
    if params.whitespace_pattern is not None:
        options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
    kind = params.kind
    if kind == "json":
        _check_json_schema(params.json)
        schema = params.json
        if schema is True:  # JSON Schema's "anything": any JSON value
            schema = {}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "json_object":
        schema = {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:  # Lark as llguidance reads it, or llama.cpp's GBNF (converted to Lark)
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as exc:
        raise GrammarError(
            f"structured_outputs.grammar does not parse: {exc}", "invalid_grammar"
        ) from None


def _check_json_schema(schema: Any) -> None:
    import jsonschema

    if isinstance(schema, bool):
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (TypeError, AttributeError, LookupError) as exc:  # e.g. "$schema": [] or 5
        raise GrammarError(
            f"structured_outputs.json is not a valid JSON Schema: {exc}", "invalid_schema"
        ) from None
    except RecursionError:  # StructuredOutputsParams bounds the depth; this is the backstop
        raise GrammarError(
            "structured_outputs.json nests too deep to check", "invalid_schema"
        ) from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise GrammarError(
            f"structured_outputs.json is not a valid JSON Schema at {where}: {exc.message}",
            "invalid_schema",
        ) from None


def clean_message(message: str) -> str:
    """llguidance's error text for a client: one line, without its verbosity markers."""
    return " ".join(message.replace("<non-verbose/>", "").split())[:500]


def _refusal(params: StructuredOutputsParams, message: str) -> GrammarError:
    """llguidance's error as the client's 400: unsupported keywords and formats apart from
    grammars and regexes that do not parse."""
    message = clean_message(message)
    kind = params.kind
    lowered = message.lower()
    unsupported = ("unimplemented", "unknown", "not supported")
    if kind in ("json", "json_object") and any(word in lowered for word in unsupported):
        return GrammarError(
            f"structured_outputs.{kind} uses what the grammar engine does not support: {message}",
            "unsupported",
        )
    return GrammarError(f"structured_outputs.{kind} does not compile: {message}", "invalid_grammar")
