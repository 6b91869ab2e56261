"""The call grammar's own rules, checked on llguidance with the packaged model's tokenizer: what
text a call may be (the arguments' numbers bounded, data keywords never rewritten)."""

from __future__ import annotations

import json

import llguidance
import pytest

from prefixserve.entrypoints.chat.tool_grammar import (
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    ToolSpec,
    bounded_numbers,
    call_schema,
    forced_call_grammar,
)
from prefixserve.model.tokenizer import Tokenizer
from prefixserve.structured_output.backend import tokenizer_json

TOOL = ToolSpec(
    "place",
    {
        "type": "object",
        "properties": {
            "lat": {"type": "number"},
            "count": {"type": "integer"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "note": {"type": ["integer", "null"]},
        },
        "required": ["lat", "count", "score"],
    },
)


@pytest.fixture(scope="module")
def accepts(default_model_dir):
    tokenizer = Tokenizer.from_pretrained(default_model_dir)
    ll = llguidance.LLTokenizer(
        tokenizer_json(tokenizer.hf_tokenizer), n_vocab=tokenizer.vocab_size
    )
    grammar = llguidance.LLMatcher.grammar_from_lark(forced_call_grammar([TOOL], parallel=False))

    def check(arguments: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar)
        text = '<tool_call>\n{"name": "place", "arguments": ' + arguments
        ids = tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and not matcher.is_error()

    return check


def test_a_calls_numbers_have_bounded_digits(accepts):
    def args(lat: str, count: str, score: str = "0.5", note: str = "null") -> str:
        return f'{{"lat": {lat}, "count": {count}, "score": {score}, "note": {note}}}'

    assert accepts(args("40.7128", "3"))
    assert accepts(args("-74.006", "-12", "1"))
    assert accepts(args("0." + "1" * MAX_FRACTION_DIGITS, "9" * MAX_INTEGER_DIGITS))
    # A digit past the bound cannot be written: the call goes on to its next key instead.
    assert not accepts(args("0." + "1" * (MAX_FRACTION_DIGITS + 1), "1"))
    assert not accepts(args("1", "9" * (MAX_INTEGER_DIGITS + 1)))
    assert not accepts(args("1" * (MAX_INTEGER_DIGITS + 2), "1"))
    assert accepts(args("1", "1", note="7"))
    assert not accepts(args("1", "1", note="1" * (MAX_INTEGER_DIGITS + 1)))
    # The schema's own bounds still hold.
    assert not accepts(args("1", "1", "1.5"))


def test_bounded_numbers_keeps_the_schemas_bounds_and_its_data():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 5},
            "b": {"type": "number", "multipleOf": 0.5},
            "c": {"type": ["number", "null"]},
            "d": {"const": {"type": "integer"}},
            "e": {"enum": [{"type": "number"}]},
        },
    }
    out = bounded_numbers(schema)
    assert out["properties"]["a"]["minimum"] == 5
    assert out["properties"]["a"]["maximum"] == 10**MAX_INTEGER_DIGITS - 1
    assert out["properties"]["b"]["multipleOf"] == 0.5
    assert out["properties"]["c"]["multipleOf"] == 10.0**-MAX_FRACTION_DIGITS
    assert out["properties"]["d"] == {"const": {"type": "integer"}}
    assert out["properties"]["e"] == {"enum": [{"type": "number"}]}
    assert "maximum" not in json.dumps(schema)  # the caller's schema is untouched


def test_call_schema_closes_objects_without_touching_their_data():
    out = call_schema({"properties": {"x": {"default": {"properties": {}}}}})
    assert out["additionalProperties"] is False
    assert out["properties"]["x"]["default"] == {"properties": {}}
