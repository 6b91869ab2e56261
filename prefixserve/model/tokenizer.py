"""Text <-> token ids: a thin wrapper over a Hugging Face tokenizer directory.

Tokenization, special tokens and chat templates all come from `transformers` / `tokenizers`
(the chat template is rendered by transformers' jinja2 sandbox); this module only fixes the
small API the engine uses and adds the streaming detokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
# transformers is imported where it is used: importing it costs seconds, and importing this
# module (hence prefixserve.model.loader.loading) should not.

# Chat messages as the OpenAI API and transformers take them: {"role": ..., "content": ...}.
Message = dict[str, Any]


class Tokenizer:
    """The engine's tokenizer: encode, decode, chat template, end-of-sequence ids.

    `eos_token_ids` is the union of the tokenizer's eos token and the `eos_token_id` entry of
    `generation_config.json` (an int or a list), because chat models end a turn with a token
    (`<|im_end|>`, `<end_of_turn>`) that is not always the tokenizer's own eos.
    """

    __slots__ = (
        "hf_tokenizer",
        "eos_token_ids",
        "bos_token_id",
        "pad_token_id",
        "vocab_size",
        "_chat_template",
    )

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        eos: set[int] = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.pad_token_id: int | None = hf_tokenizer.pad_token_id
        # len() counts added tokens too; that is the largest id the tokenizer can produce + 1.
        self.vocab_size: int = len(hf_tokenizer)
        self._chat_template: str | None = None  # the operator's, in place of the model's

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """This tokenizer rendering chats with `template` (a Jinja text) instead of the
        model's own (`--chat-template`); the same object for None. The Hugging Face tokenizer
        is shared, never changed."""
        if template is None:
            return self
        view = Tokenizer.__new__(Tokenizer)
        for name in Tokenizer.__slots__:
            setattr(view, name, getattr(self, name))
        view._chat_template = template
        return view

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json / tokenizer_config.json (+ generation_config.json) from a dir."""
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast
        from transformers.utils import logging as hf_logging

        model_dir = Path(model_dir)
        # transformers 4.57.3+ warns about a Mistral regex for every local directory; silence it.
        previous = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            if (model_dir / "tokenizer.json").is_file():
                # The fast class directly: AutoTokenizer's class lookup costs ~1 s of imports.
                hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
            else:
                from transformers import AutoTokenizer

                hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        finally:
            hf_logging.set_verbosity(previous)
        return cls(hf_tokenizer, _generation_config_eos_ids(model_dir))

    @property
    def chat_template(self) -> str | None:
        if self._chat_template is not None:
            return self._chat_template
        template = self.hf_tokenizer.chat_template
        return template if isinstance(template, str) or template is None else str(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model expects (e.g. BOS)."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf_tokenizer.convert_ids_to_tokens(list(token_ids))

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result.

        The template itself writes the special tokens (BOS, turn markers), so none are added on
        top. Raises ValueError when the model has no chat template.
        """
        if not self.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain prompt "
                "(completions) instead of chat messages"
            )
        template_kwargs.setdefault("chat_template", self.chat_template)
        ids = self.hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
        )
        if isinstance(ids, dict):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def apply_chat_template_text(
        self, messages: list[Message], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The rendered chat prompt as text (for logging and the API's `prompt` field)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        template_kwargs.setdefault("chat_template", self.chat_template)
        return self.hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )

    def incremental_detokenizer(
        self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, for streaming and stop strings.

    transformers' / vLLM's prefix-offset method: decode a short window of the latest tokens
    twice, without and with the new tokens, and emit the difference. A token that ends inside a
    multi-byte UTF-8 character decodes to U+FFFD; such a delta is held back until the
    character completes, so callers never see half a character. `text` is the whole output so
    far; `add_tokens` returns only what it added.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_skip_special", "text")

    # How many earlier tokens give context for decoding the new ones (spaces, merges).
    _CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # Starting from the prompt's tail lets the first output token decode in context (e.g.
        # SentencePiece's leading space is kept exactly as it would be in the full text).
        self._ids: list[int] = list(prompt_token_ids)[-self._CONTEXT :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip_special = skip_special_tokens
        self.text = ""

    def add_tokens(self, token_ids: int | Sequence[int]) -> str:
        """Append tokens; return the new text they completed (possibly "")."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing visible yet, or an incomplete UTF-8 sequence
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
