"""The grammar that holds a tool call to its tool's schema, in the Hermes format the packaged
templates teach (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), as a Lark
grammar for llguidance (its `%json` embeds each tool's JSON Schema).

- `required` (OpenAI) / `any` (Anthropic): one call or more (one with parallel calls off), to
  any of the tools, nothing else;
- a named function / `tool`: one call to that tool;
- `auto`: free text, and a call where the text opens one: the `<tool_call>` tag is a lazy
  trigger (llguidance's structural tags), so the text is unconstrained until the model writes
  the tag, and from there the call must parse and validate;
- `none`: no grammar (and the tools stay out of the prompt).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ToolSpec:
    """One function a request offers: its name and its arguments' JSON Schema."""

    name: str
    parameters: dict[str, Any]


# The arguments are written as Python's json.dumps writes them (", " and ": ", no other
# whitespace): the text a client sends back in its history (OpenAI's `arguments` string, or
# Anthropic's `input` dumped) renders to the very tokens that were generated, so the next turn
# hits the prefix cache through the call (docs/tools.md).
_ARGUMENTS_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists its
    properties and says nothing of others (a copy; the caller's schema is untouched). A call's
    arguments are the properties its tool declares: left open, a small model fills the call
    with keys copied from the schema ("title", "maxLength"), wasting tokens until max_tokens
    cuts the call (what LangChain's and instructor's schemas, which omit the keyword, got)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def _call_rule(index: int, tool: ToolSpec) -> str:
    head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
    parameters = closed_objects(tool.parameters or {"type": "object"})
    schema = {**parameters, "x-guidance": _ARGUMENTS_FORMAT}
    text = json.dumps(schema, separators=(",", ":"))
    return f'call_{index}: {head} %json {text} "}}"'


def _calls(tools: Sequence[ToolSpec]) -> list[str]:
    rules = [_call_rule(i, tool) for i, tool in enumerate(tools)]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    return rules


def forced_call_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """One call (or, with `parallel`, one or more) to any of `tools`, and nothing else."""
    block = '"<tool_call>\\n" call "\\n</tool_call>"'
    start = f'start: block ("\\n" block)*\nblock: {block}' if parallel else f"start: {block}"
    return "\n".join([start, *_calls(tools)])


def auto_call_grammar(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """Free text; where it opens `<tool_call>`, a call that must parse and validate (then, with
    `parallel`, more calls or the end; without, the end)."""
    more = '("\\n" "<tool_call>\\n" call "\\n</tool_call>")*' if parallel else ""
    return "\n".join(
        [
            "%llguidance {}",
            f'start: TEXT | opened "\\n" call "\\n</tool_call>" {more}',
            'opened[lazy]: TEXT "<tool_call>"',
            "TEXT: /(.|\\n)*/",
            *_calls(tools),
        ]
    )
