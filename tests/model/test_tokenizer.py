"""The Tokenizer wrapper and the streaming detokenizer, on the default model's tokenizer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from prefixserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_pretrained(default_model_dir)


def test_encode_decode_round_trip(tokenizer):
    text = "Hello, world! Prefix caching reuses KV blocks."
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_encode_matches_transformers(tokenizer, default_model_dir):
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    text = "  Leading spaces, émigré, 日本語 and 😀\n\ttabs"
    assert tokenizer.encode(text) == reference.encode(text)


def test_decode_skips_special_tokens_unless_asked(tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert "<|im_start|>" not in tokenizer.decode(ids)
    assert "<|im_start|>" in tokenizer.decode(ids, skip_special_tokens=False)


def test_chat_template_matches_transformers(tokenizer, default_model_dir):
    reference = AutoTokenizer.from_pretrained(default_model_dir)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(MESSAGES) == list(expected)
    text = tokenizer.apply_chat_template_text(MESSAGES)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text


def test_chat_template_without_generation_prompt_ends_after_the_last_turn(tokenizer):
    text = tokenizer.apply_chat_template_text(MESSAGES, add_generation_prompt=False)
    assert text.endswith("<|im_end|>\n")


def test_eos_token_ids_include_the_end_of_turn_token(tokenizer):
    im_end = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == 49152


def test_model_without_chat_template_raises_a_clear_error(default_model_dir):
    hf = AutoTokenizer.from_pretrained(default_model_dir)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template(MESSAGES)


def _stream(tokenizer, ids, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_tokens(i) for i in ids]
    return detok, deltas


def test_incremental_detokenizer_concatenation_equals_full_decode(tokenizer):
    text = "Paris is the capital of France. 日本語のテキスト 😀 naïve café — done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_incremental_detokenizer_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode("😀🇫🇷日本", add_special_tokens=False)
    assert len(ids) > 4  # byte-level pieces: several tokens per character
    _, deltas = _stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "😀🇫🇷日本"


def test_incremental_detokenizer_with_prompt_context_starts_at_the_output(tokenizer):
    prompt = tokenizer.apply_chat_template(MESSAGES)
    output = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    detok, deltas = _stream(tokenizer, output, prompt)
    assert detok.text == "The capital of France is Paris."


def test_incremental_detokenizer_accepts_several_tokens_at_once(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens(ids[:2]) + detok.add_tokens(ids[2:]) == "one two three four"


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("Paris.", add_special_tokens=False) + list(tokenizer.eos_token_ids)
    detok, _ = _stream(tokenizer, ids)
    assert detok.text == "Paris."


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_incremental_detokenizer_matches_decode_for_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert "".join(deltas) == detok.text
    # Everything except a trailing incomplete character has been emitted.
    assert full.startswith(detok.text)
    assert full[len(detok.text) :].strip("\ufffd") == ""
