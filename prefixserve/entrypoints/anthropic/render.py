"""A Messages request -> the prompt's token ids and its cache breakpoints, through the model's
chat template, or, when the request uses tools (`tools`, or `tool_use` / `tool_result` blocks in
its history), through the template that renders tools (entrypoints/chat/tool_templates.py: the
model's own when it renders them, else its family's packaged one). The history reaches the
template as the OpenAI-style messages the templates read: an assistant's `tool_use` blocks as its
`tool_calls` (arguments: the input as JSON), each `tool_result` as a `tool` message.

Where a `cache_control` breakpoint falls in the rendered prompt is found without knowing the
template: the request is rendered a second time with a unique marker after each marked block's
text; the prompt up to a marker (the other markers taken out) shares a prefix with the plain
rendering, and the breakpoint is the end of that shared prefix (a template that trims a block's
trailing space moves it back, never past the block). A tool's marker is a last key of its object,
after its schema (and, for templates that render a tool field by field, also the end of its
description); a call's is after its input. The plain rendering is tokenized with character
offsets; a breakpoint keeps the tokens that end at or before it.

Anthropic's order is tools, then system, then messages, and a later breakpoint may not outlive an
earlier one: that rule is checked in the request's order. A template may render them in another
order (the packaged ones put the tools after the system text); the engine takes breakpoints in
prompt order with no longer ttl after a shorter one, so an earlier breakpoint takes the longest
ttl of those after it: the later one holds its blocks that long anyway.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.core.kv_cache.breakpoint_spec import TTL_SECONDS, CacheBreakpoint
from prefixserve.entrypoints.anthropic.protocol import (
    CacheControl,
    InputMessage,
    TextBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    _PromptFields,
)
from prefixserve.entrypoints.chat.history import Prefix, assistant_answers
from prefixserve.entrypoints.chat.tool_templates import tool_template

# The prefix the content of a tool_result with `is_error` gets, so the model reads it as one.
ERROR_PREFIX = "Error: "


class RenderError(ValueError):
    """The request cannot become a prompt for this model (the message says why)."""


# (prompt text, its assistant answers) -> what the tenant's history holds of the text
# (GeneratedHistory.prefix with the tenant bound).
HistoryLookup = Callable[[str, list[tuple[int, str]]], Prefix]


@dataclass(slots=True)
class Rendered:
    token_ids: list[int]
    text: str
    breakpoints: tuple[CacheBreakpoint, ...]
    history: Prefix = field(default_factory=lambda: Prefix(0, [], 0, []))
    num_answers: int = 0  # assistant turns in its messages


@dataclass(slots=True)
class _Marks:
    """Marker strings and the ttl of the breakpoint each stands for (in the order they were
    made: the request's order)."""

    nonce: str
    ttls: list[str]

    def new(self, cache_control: CacheControl) -> str:
        self.ttls.append(cache_control.ttl)
        return self.marker(len(self.ttls) - 1)

    def add(self, text: str, cache_control: CacheControl | None) -> str:
        return text if cache_control is None else text + self.new(cache_control)

    def marker(self, index: int) -> str:
        return f"\ue000{self.nonce}:{index}\ue001"


def uses_tools(body: _PromptFields) -> bool:
    """Whether `body` is rendered with the tool-capable template."""
    return bool(body.tools) or any(
        isinstance(b, ToolUseBlock | ToolResultBlock) for m in body.messages for b in m.blocks()
    )


def render(tokenizer: Any, body: _PromptFields, history: HistoryLookup | None = None) -> Rendered:
    """The prompt of `body` for `tokenizer`'s chat template. RenderError for what the model
    cannot take (tools without a template that renders them, a final assistant message, more
    than four breakpoints, a template that refuses the messages). `history`: the tenant's
    generated history (entrypoints/chat/history.py), whose ids the prompt starts with where
    its text starts with a recorded answer's."""
    template = _check_shape(tokenizer, body)
    marks = _Marks(uuid.uuid4().hex, [])
    messages = _messages(body, None)
    plain = _template_text(tokenizer, template, messages, _tools(body, None))
    marked_tools = _tools(body, marks)  # first: tools, then system, then messages
    marked = _template_text(tokenizer, template, _messages(body, marks), marked_tools)
    if len(marks.ttls) > 4:
        raise RenderError(
            f"at most 4 blocks may carry cache_control; this request has {len(marks.ttls)}"
        )
    boundaries = [_boundary(marked, plain, marks, i) for i in range(len(marks.ttls))]
    answers = assistant_answers(messages)
    found = Prefix(0, [], 0, [])
    if history is not None:
        found = history(plain, answers)
    tokens = _Tokens.of(tokenizer, plain, found)
    positions = [tokens.position(boundary) for boundary in boundaries]
    if None in positions:  # the recorded ids do not decode to the text: tokenize it all
        found = Prefix(0, [], 0, found.rerendered)
        tokens = _Tokens.of(tokenizer, plain, found)
        positions = [tokens.position(boundary) for boundary in boundaries]
    points = _in_prompt_order(positions, [TTL_SECONDS[ttl] for ttl in marks.ttls])
    breakpoints = tuple(CacheBreakpoint(n, ttl) for n, ttl in points)
    return Rendered(tokens.ids, plain, breakpoints, found, len(answers))


@dataclass(slots=True)
class _Tokens:
    """A prompt's ids: the history's ids for its first `reused_chars` characters, then the
    rest tokenized with each token's end (a character offset in the prompt)."""

    tokenizer: Any
    text: str
    reused: list[int]
    reused_chars: int
    ids: list[int]
    ends: list[int]

    @classmethod
    def of(cls, tokenizer: Any, text: str, found: Prefix) -> _Tokens:
        start = found.num_chars
        rest = tokenizer.hf_tokenizer(
            text[start:], add_special_tokens=False, return_offsets_mapping=True
        )
        ends = [start + end for _, end in rest["offset_mapping"]]
        ids = found.ids + list(rest["input_ids"])
        return cls(tokenizer, text, found.ids, start, ids, ends)

    def position(self, boundary: int) -> int | None:
        """The number of leading tokens that end at or before character `boundary`; None where
        it falls in the reused ids and they do not decode to the prompt's text."""
        if boundary >= self.reused_chars:
            return len(self.reused) + bisect.bisect_right(self.ends, boundary)
        lo, hi = 0, len(self.reused)  # the most leading reused ids whose text fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._decoded(mid)) <= boundary:
                lo = mid
            else:
                hi = mid - 1
        return lo if self.text.startswith(self._decoded(lo)) else None

    def _decoded(self, count: int) -> str:
        text = self.tokenizer.hf_tokenizer.decode(
            self.reused[:count], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text.rstrip("\ufffd")  # a character the next id completes


def _check_shape(tokenizer: Any, body: _PromptFields) -> str | None:
    """The template to render `body` with (None: the model's own)."""
    if not tokenizer.chat_template:
        raise RenderError("this model has no chat template, so it cannot take messages")
    if body.messages[-1].role == "assistant":
        raise RenderError(
            "the last message is the assistant's (a prefill); this server answers a final "
            "user message only"
        )
    if not uses_tools(body):
        return None
    template = tool_template(tokenizer.hf_tokenizer, tokenizer.chat_template)
    if template is None:
        raise RenderError(
            "tools: this model's chat template renders no tools and no packaged tool template "
            "fits it; start the server with --chat-template FILE"
        )
    return template


def _messages(body: _PromptFields, marks: _Marks | None) -> list[dict[str, Any]]:
    """The chat template's messages; with `marks`, a marker after each marked block."""
    out: list[dict[str, Any]] = []
    system = [_text(b.text, b.cache_control, marks) for b in body.system_blocks()]
    if system:
        out.append({"role": "system", "content": "\n".join(system)})
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        # Automatic caching: one more breakpoint, on the request's last block.
        automatic = body.cache_control if i == last else None
        if message.role == "assistant":
            out.append(_assistant(message, marks, automatic))
        else:
            out.extend(_user(message, marks, automatic))
    return out


def _marked_blocks(
    message: InputMessage, marks: _Marks | None, automatic: CacheControl | None
) -> list[tuple[Any, str]]:
    """Each block of `message` with its text (a call's: its input as JSON) and its markers."""
    blocks = message.blocks()
    out = []
    for i, block in enumerate(blocks):
        if isinstance(block, ToolUseBlock):
            # As the call grammar writes arguments (json.dumps' separators), non-ASCII as is.
            text = json.dumps(block.input, ensure_ascii=False)
        elif isinstance(block, ToolResultBlock):
            text = _result_text(block, marks)
        else:
            text = block.text
        text = _text(text, block.cache_control, marks)
        if i == len(blocks) - 1:
            text = _text(text, automatic, marks)
        out.append((block, text))
    return out


def _result_text(block: ToolResultBlock, marks: _Marks | None) -> str:
    text = "\n".join(_text(b.text, b.cache_control, marks) for b in block.content)
    return ERROR_PREFIX + text if block.is_error else text


def _assistant(
    message: InputMessage, marks: _Marks | None, automatic: CacheControl | None
) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block, text in _marked_blocks(message, marks, automatic):
        if isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": text}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            texts.append(text)
    if not calls:
        return {"role": "assistant", "content": "\n".join(texts)}
    return {"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls}


def _user(
    message: InputMessage, marks: _Marks | None, automatic: CacheControl | None
) -> list[dict[str, Any]]:
    """A user message: its tool results as `tool` messages, each run of its text blocks as one
    user message, in the blocks' order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block, text in _marked_blocks(message, marks, automatic):
        if isinstance(block, TextBlock):
            texts.append(text)
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _text(text: str, cache_control: CacheControl | None, marks: _Marks | None) -> str:
    return text if marks is None else marks.add(text, cache_control)


def _tools(body: _PromptFields, marks: _Marks | None) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [_tool(tool, marks) for tool in body.tools]


def _tool(tool: Tool, marks: _Marks | None) -> dict[str, Any]:
    """A tool as the templates read it (OpenAI's function shape); marked, its marker is a last
    key (the end of the tool in a template that dumps it as JSON) and ends its description."""
    marker = None if marks is None or tool.cache_control is None else marks.new(tool.cache_control)
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description + (marker or "")
    function["parameters"] = tool.input_schema
    rendered: dict[str, Any] = {"type": "function", "function": function}
    if marker is not None:
        rendered[marker] = ""
    return rendered


def _template_text(
    tokenizer: Any,
    template: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str:
    kwargs: dict[str, Any] = {} if tools is None else {"tools": tools}
    if template is not None:
        kwargs["chat_template"] = template
    try:
        return tokenizer.apply_chat_template_text(messages, add_generation_prompt=True, **kwargs)
    except ValueError as exc:
        raise RenderError(str(exc)) from exc
    except Exception as exc:  # a template raising on these messages (e.g. role order)
        raise RenderError(f"the chat template rejected the messages: {exc}") from exc


def _boundary(marked: str, plain: str, marks: _Marks, index: int) -> int:
    """The character offset in `plain` where breakpoint `index` falls (its marker's last
    place: a tool's is its last key)."""
    position = marked.rfind(marks.marker(index))
    if position < 0:
        raise RenderError("the chat template dropped a block that carries cache_control")
    prefix = marked[:position]
    for other in range(len(marks.ttls)):
        marker = marks.marker(other)
        # A tool's marker key goes with its JSON entry (`, "<marker>": ""`, however the
        # template's tojson spaces it), or the tools after it would differ from `plain`.
        prefix = re.sub(r',\s*"' + re.escape(marker) + r'"\s*:\s*""', "", prefix)
        prefix = prefix.replace(marker, "")
    return len(os.path.commonprefix([prefix, plain]))


def _in_prompt_order(positions: list[int], ttls: list[int]) -> list[tuple[int, int]]:
    """(token count, ttl_s) breakpoints in prompt order from the request's (`positions` and
    `ttls` in the request's order), one per token count with the longest ttl asked for it:
    breakpoints that end at one token keep one prefix, one cache entry (an explicit `1h` on the
    last block and the top-level automatic `5m` are one `1h` breakpoint). A `1h` after a `5m` in
    the request's order is a RenderError; in prompt order an earlier breakpoint takes the
    longest ttl of the later ones (the later one holds its blocks that long anyway)."""
    longest: dict[int, int] = {}
    for num_tokens, ttl_s in zip(positions, ttls, strict=True):
        longest[num_tokens] = max(longest.get(num_tokens, 0), ttl_s)
    request_order = list(dict.fromkeys(positions))
    _check_ttl_order([longest[n] for n in request_order])
    points = sorted(longest.items())
    for i in range(len(points) - 2, -1, -1):
        num_tokens, ttl_s = points[i]
        points[i] = (num_tokens, max(ttl_s, points[i + 1][1]))
    return points


def _check_ttl_order(ttls: list[int]) -> None:
    for earlier, later in zip(ttls, ttls[1:], strict=False):
        if later > earlier:
            raise RenderError(
                "a cache_control breakpoint with ttl '1h' cannot come after one with ttl '5m' "
                "(tools, then system, then messages)"
            )
