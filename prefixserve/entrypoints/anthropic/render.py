"""A Messages request -> the prompt's token ids and its cache breakpoints, through the model's
chat template.

Where a `cache_control` breakpoint falls in the rendered prompt is found without knowing the
template: the request is rendered a second time with a unique marker after each marked block's
text; the prompt up to a marker (the other markers taken out) shares a prefix with the plain
rendering, and the breakpoint is the end of that shared prefix (a template that trims a block's
trailing space moves it back, never past the block). The plain rendering is tokenized with
character offsets; a breakpoint keeps the tokens that end at or before it. Order is Anthropic's:
tools, then system, then messages.
"""

from __future__ import annotations

import bisect
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefixserve.core.kv_cache.breakpoint_spec import TTL_SECONDS, CacheBreakpoint
from prefixserve.entrypoints.anthropic.protocol import CacheControl, Tool, _PromptFields


class RenderError(ValueError):
    """The request cannot become a prompt for this model (the message says why)."""


@dataclass(slots=True)
class Rendered:
    token_ids: list[int]
    text: str
    breakpoints: tuple[CacheBreakpoint, ...]


@dataclass(slots=True)
class _Marks:
    """Marker strings and the ttl of the breakpoint each stands for."""

    nonce: str
    ttls: list[str]

    def add(self, text: str, cache_control: CacheControl | None) -> str:
        if cache_control is None:
            return text
        self.ttls.append(cache_control.ttl)
        return text + self.marker(len(self.ttls) - 1)

    def marker(self, index: int) -> str:
        return f"\ue000{self.nonce}:{index}\ue001"


def render(tokenizer: Any, body: _PromptFields) -> Rendered:
    """The prompt of `body` for `tokenizer`'s chat template. RenderError for what the model
    cannot take (tools without a template that renders them, a final assistant message, more
    than four breakpoints, a template that refuses the messages)."""
    _check_shape(tokenizer, body)
    marks = _Marks(uuid.uuid4().hex, [])
    plain = _template_text(tokenizer, _messages(body, None), _tools(body, None))
    marked = _template_text(tokenizer, _messages(body, marks), _tools(body, marks))
    if len(marks.ttls) > 4:
        raise RenderError(
            f"at most 4 blocks may carry cache_control; this request has {len(marks.ttls)}"
        )
    boundaries = [_boundary(marked, plain, marks, i) for i in range(len(marks.ttls))]
    encoding = tokenizer.hf_tokenizer(plain, add_special_tokens=False, return_offsets_mapping=True)
    token_ids = list(encoding["input_ids"])
    ends = [end for _, end in encoding["offset_mapping"]]
    points = _one_per_token(
        (bisect.bisect_right(ends, boundary), TTL_SECONDS[ttl])
        for boundary, ttl in zip(boundaries, marks.ttls, strict=True)
    )
    _check_ttl_order(points)
    return Rendered(token_ids, plain, tuple(CacheBreakpoint(n, ttl) for n, ttl in points))


def _check_shape(tokenizer: Any, body: _PromptFields) -> None:
    if not tokenizer.chat_template:
        raise RenderError("this model has no chat template, so it cannot take messages")
    if body.tools and "tools" not in tokenizer.chat_template:
        raise RenderError(
            "this model's chat template does not render tools; send the request without "
            "`tools` (describe them in the system prompt instead)"
        )
    if body.messages[-1].role == "assistant":
        raise RenderError(
            "the last message is the assistant's (a prefill); this server answers a final "
            "user message only"
        )


def _messages(body: _PromptFields, marks: _Marks | None) -> list[dict[str, str]]:
    """The chat template's messages; with `marks`, a marker after each marked block."""
    out = []
    system = [_text(b.text, b.cache_control, marks) for b in body.system_blocks()]
    if system:
        out.append({"role": "system", "content": "\n".join(system)})
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        blocks = message.blocks()
        parts = [_text(b.text, b.cache_control, marks) for b in blocks]
        if i == last and body.cache_control is not None:
            # Automatic caching: one more breakpoint, on the request's last block.
            parts[-1] = _text(parts[-1], body.cache_control, marks)
        out.append({"role": message.role, "content": "\n".join(parts)})
    return out


def _text(text: str, cache_control: CacheControl | None, marks: _Marks | None) -> str:
    return text if marks is None else marks.add(text, cache_control)


def _tools(body: _PromptFields, marks: _Marks | None) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [_tool(tool, marks) for tool in body.tools]


def _tool(tool: Tool, marks: _Marks | None) -> dict[str, Any]:
    description = _text(tool.description or "", tool.cache_control, marks)
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": description,
            "parameters": tool.input_schema,
        },
    }


def _template_text(
    tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None
) -> str:
    kwargs = {} if tools is None else {"tools": tools}
    try:
        return tokenizer.apply_chat_template_text(messages, add_generation_prompt=True, **kwargs)
    except ValueError as exc:
        raise RenderError(str(exc)) from exc
    except Exception as exc:  # a template raising on these messages (e.g. role order)
        raise RenderError(f"the chat template rejected the messages: {exc}") from exc


def _boundary(marked: str, plain: str, marks: _Marks, index: int) -> int:
    """The character offset in `plain` where breakpoint `index` falls."""
    position = marked.find(marks.marker(index))
    if position < 0:
        raise RenderError("the chat template dropped a block that carries cache_control")
    prefix = marked[:position]
    for other in range(len(marks.ttls)):
        prefix = prefix.replace(marks.marker(other), "")
    return len(os.path.commonprefix([prefix, plain]))


def _one_per_token(points: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(token count, ttl_s) breakpoints in prompt order, one per token count with the longest
    ttl asked for it: breakpoints that end at one token keep one prefix, one cache entry (an
    explicit `1h` on the last block and the top-level automatic `5m` are one `1h` breakpoint)."""
    longest: dict[int, int] = {}
    for num_tokens, ttl_s in points:
        longest[num_tokens] = max(longest.get(num_tokens, 0), ttl_s)
    return sorted(longest.items())


def _check_ttl_order(points: list[tuple[int, int]]) -> None:
    for (_, earlier), (_, later) in zip(points, points[1:], strict=False):
        if later > earlier:
            raise RenderError(
                "a cache_control breakpoint with ttl '1h' cannot come after one with ttl '5m' "
                "(tools, then system, then messages)"
            )
