"""A Messages prompt that starts with a recorded answer's ids keeps its cache breakpoints where
the tokenized prompt has them: a breakpoint inside the reused ids is found by decoding them, and
ids that do not decode to the prompt's text are not reused at all (render.py `_Tokens`)."""

from __future__ import annotations

import functools

from prefixserve.entrypoints.anthropic import protocol as a
from prefixserve.entrypoints.anthropic.render import render
from prefixserve.entrypoints.chat.history import GeneratedHistory
from prefixserve.model.tokenizer import Tokenizer

SYSTEM = "You answer briefly. " * 8
FIRST = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi there.", "cache_control": {"type": "ephemeral"}}],
    }
]


def _body(messages: list) -> a.MessagesRequest:
    return a.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": messages}
    )


def _recorded(tokenizer: Tokenizer, answer_ids: list[int]) -> tuple[GeneratedHistory, list]:
    """A history holding the first turn answered with `answer_ids`, and the next turn's messages."""
    first = render(tokenizer, _body(FIRST))
    answer = tokenizer.hf_tokenizer.decode(answer_ids)
    history = GeneratedHistory()
    history.record("t", first.text + answer, first.token_ids + answer_ids, answer, 1)
    messages = [
        *FIRST,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "More?"},
    ]
    return history, messages


def test_a_breakpoint_inside_the_reused_ids_falls_where_the_tokenizer_puts_it(default_model_dir):
    tokenizer = Tokenizer.from_pretrained(default_model_dir)
    # "\n\n" written as two tokens, which the tokenizer reads as one: the ids differ from a
    # re-tokenization, the text does not.
    newline = tokenizer.hf_tokenizer.encode("\n", add_special_tokens=False)
    answer_ids = tokenizer.hf_tokenizer.encode("Hello", add_special_tokens=False) + newline * 2
    history, messages = _recorded(tokenizer, answer_ids)
    plain = render(tokenizer, _body(messages))
    reused = render(tokenizer, _body(messages), functools.partial(history.prefix, "t"))
    assert reused.history.ids and reused.token_ids[: len(reused.history.ids)] == reused.history.ids
    assert reused.token_ids != plain.token_ids
    assert reused.breakpoints == plain.breakpoints  # the first user turn ends before the answer
    assert reused.num_answers == 1 and reused.history.rerendered == []


def test_ids_that_do_not_decode_to_the_prompt_are_not_reused(default_model_dir):
    tokenizer = Tokenizer.from_pretrained(default_model_dir)
    history, messages = _recorded(
        tokenizer, tokenizer.hf_tokenizer.encode("Hello", add_special_tokens=False)
    )
    first = render(tokenizer, _body(FIRST))
    forged = GeneratedHistory()  # the same text recorded with other ids
    text = first.text + "Hello"
    forged.record("t", text, [7] * len(first.token_ids) + [8], "Hello", 1)
    plain = render(tokenizer, _body(messages))
    reused = render(tokenizer, _body(messages), functools.partial(forged.prefix, "t"))
    assert reused.token_ids == plain.token_ids
    assert reused.breakpoints == plain.breakpoints
