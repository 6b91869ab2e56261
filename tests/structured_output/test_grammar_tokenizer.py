"""The grammar engine must see the very bytes the client sees: llguidance reads each token's
bytes from the tokenizer's JSON, and a vocabulary it misreads (a byte-level BPE whose decoder
is a Sequence, as GGUF conversions write it) would make it take "Ġ" for a letter instead of a
space: enums with spaces could never be written and length bounds would count wrong."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.model.loader.default_model import ensure_gemma3_270m
from prefixserve.model.tokenizer import Tokenizer
from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.backend import tokenizer_json

TEXTS = [
    "hello world",
    "two\nlines\n\n  indented\ttab",
    'JSON {"a": [1, 2], "b": "c d"}',
    "accents: café, naïve, Zürich; Greek: λόγος; CJK: 東京; emoji: 🚀",
    "<tool_call>\n{}\n</tool_call>",
]


def _check(tokenizer: Tokenizer) -> None:
    ll = llguidance.LLTokenizer(
        tokenizer_json(tokenizer.hf_tokenizer), n_vocab=tokenizer.vocab_size
    )
    for text in TEXTS:
        ids = tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
        assert ll.decode_bytes(ids) == text.encode(), text


def test_the_grammar_sees_the_bytes_the_client_sees(default_model_dir):
    _check(Tokenizer.from_pretrained(default_model_dir))


def test_the_grammar_sees_the_bytes_the_client_sees_with_gemma3():
    _check(Tokenizer.from_pretrained(ensure_gemma3_270m()))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_enums_with_spaces_and_patterns_with_newlines_can_be_written(
    default_model_exact, temperature
):
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["New York", "Los Angeles", "San Francisco"]},
            "note": {"type": "string", "pattern": "^[a-z]+ [a-z]+$", "maxLength": 30},
        },
        "required": ["city", "note"],
        "additionalProperties": False,
    }
    llm = LLM(dtype=default_model_exact.config.dtype, loaded_model=default_model_exact)
    params = SamplingParams(
        max_tokens=60,
        temperature=temperature,
        seed=1,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    out = llm.generate(["A US city as JSON: "], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), schema)
    lines = SamplingParams(
        # Bounded words: the grammar makes room for the newline whatever the model prefers.
        max_tokens=20,
        temperature=temperature,
        seed=1,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{1,8}\n[a-z]{1,8}"),
    )
    text = llm.generate(["Two words on two lines: "], lines, use_tqdm=False)[0].outputs[0].text
    assert len(text.split("\n")) == 2 and all(part.isalpha() for part in text.split("\n"))


def test_a_constraint_too_deep_or_not_unicode_is_refused_before_anything_recurses():
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["items"] = {}
        node = node["items"]
    cases = [
        (dict(json=deep), "nests deeper than"),
        (dict(json="[" * 5000 + "]" * 5000), "nests deeper than"),
        (dict(regex="a\udc00"), "not valid Unicode"),
        (dict(choice=["ok", "x\ud800"]), "not valid Unicode"),
        (dict(json={"enum": ["\udfff"]}), "not valid Unicode"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**fields)
