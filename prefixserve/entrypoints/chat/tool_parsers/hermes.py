"""The Hermes tool-call format (NousResearch's; vLLM's `hermes` parser reads the same): each call
is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the answer's text, any text
before the first call is the answer's content.

Text that does not parse as a call (malformed JSON, no name, arguments that are not an object,
an unclosed tag) stays text: a model's slip is the client's text to see, never a 500.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: dict  # the arguments object

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI's `arguments` string, written as the call grammar writes them
        (json.dumps's separators, characters as they are), so a client that sends it back
        renders the tokens that were generated."""
        return json.dumps(self.arguments, ensure_ascii=False)


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], arguments)


def render_calls(content: str | None, calls: list[tuple[str, str]]) -> str:
    """An assistant turn as the packaged templates render it and the call grammar generates it:
    its content, then each (name, arguments JSON) call in its tags, a newline between."""
    parts = [content] if content else []
    parts += [
        f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'
        for name, arguments in calls
    ]
    return "\n".join(parts)


def parse_hermes(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished answer. Content is the text outside the calls (None when
    only calls and whitespace); a block that does not parse is left in the content as text."""
    calls: list[ParsedToolCall] = []
    content: list[str] = []
    rest = text
    while True:
        start = rest.find(OPEN)
        if start < 0:
            content.append(rest)
            break
        end = _close_of(rest, start + len(OPEN), final=True)
        if end < 0:
            content.append(rest)
            break
        call = _parse_call(rest[start + len(OPEN) : end])
        if call is None:
            content.append(rest[: end + len(CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(CLOSE) :]
    joined = "".join(content)
    if calls:
        joined = joined.strip()
    return (joined or None), calls


@dataclass(slots=True)
class StreamEvent:
    """One piece of a streamed answer: text, or a call's start (index, name) or arguments."""

    kind: str  # "text" | "call_start" | "call_arguments"
    text: str = ""
    index: int = 0
    name: str = ""


# A call's head as the call grammar writes it (whitespace as JSON allows it), up to the opening
# brace of its arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}\s*")


@dataclass(slots=True)
class _ArgumentsScan:
    """Where a streamed call's arguments object stands: its nesting depth, inside a string or
    not, after a backslash or not (JSON's lexing, enough to find the object's end)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end_in(self, text: str) -> int:
        """The length of `text` up to and including the object's closing brace, or -1 when the
        object goes on past it (the state is kept for the next piece)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


def _close_of(text: str, start: int, final: bool) -> int:
    """Where the closing tag of the call whose body starts at text[start] is: the first tag after
    the body's JSON object, whose strings may hold the tag itself (a sampled argument did:
    `"query": "Cuisine</tool_call> Paris"`); the first tag at all when the body is no object.
    -1 when there is none yet; while the object is still open that is -1 too, unless `final`
    (the whole answer: an object that never closes is text, up to the first tag as before).
    No tag at all is -1 at once: a stream asks on every token, and only a tag sends it through
    the object's characters."""
    first = text.find(CLOSE, start)
    if first < 0:
        return -1
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        end = _ArgumentsScan().end_in(text[i:])
        if end >= 0:
            return text.find(CLOSE, i + end)
        if not final:
            return -1
    return first


@dataclass(slots=True)
class HermesStreamParser:
    """Incremental: `feed(delta)` -> events, `finish()` -> the events left. Text is released as
    soon as it cannot be the start of `<tool_call>`; a call is released when its closing tag
    arrives (its name, then its arguments as one JSON piece, as OpenAI streams them in pieces a
    client concatenates); a block that does not parse is released as text.

    `early`, for calls a grammar holds to the format (the server's): a call's name is released as
    soon as its head is written, then its arguments piece by piece as they are generated, as
    OpenAI streams them; the pieces are the generated text (the whole answer's `arguments` is
    that text parsed and dumped again: the same object). A call cut by max_tokens streams as far
    as it was written."""

    early: bool = False
    _buffer: str = ""
    _calls: int = 0
    _in_call: bool = False
    _saw_call: bool = False
    _scan: _ArgumentsScan | None = None  # the streamed call's arguments, while they are open
    _closing: bool = False  # the streamed call's arguments ended: its tail and tag are next
    events: list[StreamEvent] = field(default_factory=list)

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        return self._drain(final=False)

    def _drain(self, final: bool) -> list[StreamEvent]:
        """The events the buffer gives now; `final`: no more text comes (a call's object that
        never closed ends at its first closing tag, as parse_hermes reads it)."""
        out: list[StreamEvent] = []
        while self._buffer:
            if self._in_call and self.early and self._stream_call(out):
                continue
            if self._in_call:
                if self._scan is not None or self._closing:
                    break  # a streamed call waits for more of itself
                end = _close_of(self._buffer, 0, final)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                out.extend(self._call_events(body))
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._text(out, self._buffer[:start].rstrip())
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag_suffix(self._buffer)
            # Trailing whitespace waits too: before a call it is not content (parse_hermes
            # strips it), before more text it is.
            head = self._buffer[: len(self._buffer) - keep]
            keep += len(head) - len(head.rstrip())
            self._text(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return out

    def _stream_call(self, out: list[StreamEvent]) -> bool:
        """One step of an early call: its head (-> call_start), a piece of its arguments, or its
        tail and closing tag. False when the buffer holds nothing this step can take."""
        if self._closing:
            end = self._buffer.find(CLOSE)
            if end < 0:
                return False
            # The grammar writes `}` then the tag; anything else is past a call already sent.
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._in_call = self._closing = False
            return True
        if self._scan is None:
            head = _HEAD.match(self._buffer)
            if head is None:
                return False
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return False
            self._buffer = self._buffer[head.end() :]
            self._scan = _ArgumentsScan()
            out.append(StreamEvent("call_start", index=self._calls, name=name))
            self._calls += 1
            self._saw_call = True
            return True
        end = self._scan.end_in(self._buffer)
        piece = self._buffer if end < 0 else self._buffer[:end]
        self._buffer = self._buffer[len(piece) :]
        out.append(StreamEvent("call_arguments", index=self._calls - 1, text=piece))
        if end >= 0:
            self._scan, self._closing = None, True
        return end >= 0 and bool(self._buffer)

    def finish(self) -> list[StreamEvent]:
        out = self._drain(final=True)
        if self._scan is not None or self._closing:
            pass  # a streamed call cut short: sent as far as it was written
        elif self._in_call:
            self._text(out, OPEN + self._buffer)
        elif self._buffer.strip() or not self._saw_call:
            self._text(out, self._buffer)
        self._buffer, self._in_call = "", False
        self._scan, self._closing = None, False
        return out

    @property
    def num_calls(self) -> int:
        return self._calls

    def _text(self, out: list[StreamEvent], text: str) -> None:
        if self._saw_call:
            text = text.strip()  # whitespace between calls is not content
        if text:
            out.append(StreamEvent("text", text=text))

    def _call_events(self, body: str) -> list[StreamEvent]:
        call = _parse_call(body)
        if call is None:
            out: list[StreamEvent] = []
            self._text(out, OPEN + body + CLOSE)
            return out
        index = self._calls
        self._calls += 1
        self._saw_call = True
        return [
            StreamEvent("call_start", index=index, name=call.name),
            StreamEvent("call_arguments", index=index, text=call.arguments_json),
        ]


def _partial_tag_suffix(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
