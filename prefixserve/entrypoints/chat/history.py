"""A history that stays cached: the prompt of an agent's next turn reuses the exact token ids
this server computed for the turns before it, not a re-tokenization of their text.

When a chat answer finishes, the server records (per tenant) the rendered text of its prompt
plus its answer, and the ids that were computed for them: the prompt's ids, then the generated
ids. When a later prompt of the same tenant renders to text that starts with a recorded text,
its ids start with the recorded ids and only the rest is tokenized. A re-tokenization could
split the same text otherwise (the model may have written "\\n\\n" as two tokens that the
tokenizer reads as one), and every block after the first difference would miss the prefix cache.

Bounds: entries per tenant (least recently used out first), token ids per tenant, tenants in
all (the least recently active tenant's entries out first). Entries are never shared between
tenants (their keys include the tenant): one tenant's history says nothing of another's.

Each answer's own text is remembered too (a digest), so that a later request whose history holds
an answer of this server that does not start a recorded prefix (a template that renders it
otherwise: a dropped reasoning block, a rewritten call) is told so by turn index
(`history_rerendered` in its cache report) instead of reading as an ordinary miss.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.chat.tool_parsers.hermes import render_calls
from prefixserve.outputs import CompletionOutput

MAX_ENTRIES_PER_TENANT = 64
MAX_TOKENS_PER_TENANT = 1 << 18
MAX_TENANTS = 1024


def assistant_answers(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(index, the text the model generated for it) of each assistant message of a chat's
    OpenAI-style messages (its calls rendered as the Hermes templates write them)."""
    out = []
    for index, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())
        ]
        out.append((index, render_calls(m["content"], calls) if calls else m["content"] or ""))
    return out


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(slots=True)
class _Entry:
    ids: array  # int32 token ids
    num_answers: int  # assistant turns the recorded text holds (its prompt's, plus this one)


@dataclass(slots=True)
class _Tenant:
    entries: OrderedDict[tuple[int, bytes], _Entry] = field(default_factory=OrderedDict)
    answers: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    num_tokens: int = 0


@dataclass(slots=True)
class Prefix:
    """What the history holds of a text: its first `num_chars` characters were computed as
    `ids`, covering `num_answers` assistant turns; `rerendered`: message indexes of this
    server's answers after them that rendered to other text."""

    num_chars: int
    ids: list[int]
    num_answers: int
    rerendered: list[int]


@dataclass(slots=True)
class Rendered:
    """A prompt's ids and what the history gave it."""

    ids: list[int]
    reused_tokens: int  # leading ids taken from a recorded turn
    num_answers_reused: int  # the assistant turns those ids cover
    rerendered: list[int]  # message indexes of this server's answers that were re-tokenized


class GeneratedHistory:
    """Per tenant: recorded (prompt + answer) texts -> their computed token ids. Thread-safe."""

    def __init__(
        self,
        max_entries_per_tenant: int = MAX_ENTRIES_PER_TENANT,
        max_tokens_per_tenant: int = MAX_TOKENS_PER_TENANT,
        max_tenants: int = MAX_TENANTS,
    ) -> None:
        self.max_entries_per_tenant = max_entries_per_tenant
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[Hashable, _Tenant] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def keeps_any(self) -> bool:
        """False where a bound is 0: nothing is remembered."""
        return min(self.max_entries_per_tenant, self.max_tokens_per_tenant, self.max_tenants) > 0

    def record(
        self,
        tenant: Hashable,
        text: str,
        ids: Sequence[int],
        answer_text: str,
        num_answers: int,
    ) -> None:
        """`text` (a prompt's rendered text and its answer's) was computed as `ids`;
        `num_answers` assistant turns in it, the answer included."""
        if not self.keeps_any or len(ids) > self.max_tokens_per_tenant:
            return
        key = (len(text), _digest(text))
        with self._lock:
            book = self._tenant(tenant)
            old = book.entries.pop(key, None)
            if old is not None:
                book.num_tokens -= len(old.ids)
            book.entries[key] = _Entry(array("i", ids), num_answers)
            book.num_tokens += len(ids)
            book.answers[_digest(answer_text)] = None
            book.answers.move_to_end(_digest(answer_text))
            while len(book.answers) > 4 * self.max_entries_per_tenant:
                book.answers.popitem(last=False)
            while book.entries and (
                len(book.entries) > self.max_entries_per_tenant
                or book.num_tokens > self.max_tokens_per_tenant
            ):
                _, dropped = book.entries.popitem(last=False)
                book.num_tokens -= len(dropped.ids)

    def prefix(
        self, tenant: Hashable, text: str, answers: Sequence[tuple[int, str]] = ()
    ) -> Prefix:
        """The longest recorded text `text` starts with, and its ids. `answers`: (message index,
        text) of the request's assistant turns, in order, to tell which of this server's answers
        were not reused."""
        with self._lock:
            book = self._tenants.get(tenant)
            match = None if book is None else self._longest(book, text)
            if match is not None:
                book.entries.move_to_end(match[0])
                self._tenants.move_to_end(tenant)
            known = set() if book is None else {d for d in book.answers}
        found = Prefix(0, [], 0, [])
        if match is not None:
            (length, _), entry = match
            found = Prefix(length, entry.ids.tolist(), entry.num_answers, [])
        found.rerendered = [
            index
            for turn, (index, answer) in enumerate(answers)
            if turn >= found.num_answers and _digest(answer) in known
        ]
        return found

    def tokenize(
        self,
        tenant: Hashable,
        text: str,
        encode: Callable[[str], list[int]],
        answers: Sequence[tuple[int, str]] = (),
    ) -> Rendered:
        """The ids of `text`: the longest recorded prefix's ids, then `encode` of the rest
        (`prefix` says what `answers` is for)."""
        found = self.prefix(tenant, text, answers)
        ids = found.ids + encode(text[found.num_chars :])
        return Rendered(ids, len(found.ids), found.num_answers, found.rerendered)

    def record_answer(
        self,
        tenant: Hashable,
        prompt: tuple[str, Sequence[int]],
        answer: CompletionOutput,
        eos_token_ids: Collection[int],
        num_answers: int,
    ) -> None:
        """Remember a finished answer for the tenant's next turn: `prompt` (its rendered text
        and ids) and the answer's text and ids (without a final end-of-turn token, which the
        template writes itself); `num_answers`: assistant turns in the prompt's messages. An
        answer cut by a stop string, or that did not finish, is not recorded (its text and ids
        no longer agree, or it was not answered)."""
        if isinstance(answer.stop_reason, str) or answer.finish_reason not in ("stop", "length"):
            return
        ids = list(answer.token_ids)
        if ids and ids[-1] in eos_token_ids:
            ids.pop()
        text, prompt_ids = prompt
        self.record(tenant, text + answer.text, [*prompt_ids, *ids], answer.text, num_answers + 1)

    @staticmethod
    def _longest(book: _Tenant, text: str) -> tuple[tuple[int, bytes], _Entry] | None:
        lengths = sorted({n for n, _ in book.entries if n <= len(text)})
        hasher = hashlib.blake2b(digest_size=16)
        done, best = 0, None
        for n in lengths:
            hasher.update(text[done:n].encode("utf-8", "surrogatepass"))
            done = n
            key = (n, hasher.copy().digest())
            if key in book.entries:
                best = (key, book.entries[key])
        return best

    def _tenant(self, tenant: Hashable) -> _Tenant:
        book = self._tenants.get(tenant)
        if book is None:
            book = self._tenants[tenant] = _Tenant()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(tenant)
        return book
