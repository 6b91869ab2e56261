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
from collections.abc import Callable, Sequence
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


# Keywords whose values are JSON data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _walk(rewrite: Callable[[Any], Any], key: str, value: Any) -> Any:
    return value if key in _DATA_KEYWORDS else rewrite(value)


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
    out = {key: _walk(closed_objects, key, value) for key, value in schema.items()}
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


# The digits a call's number may have where its schema bounds none (`bounded_numbers`).
MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 9
_NUMBER_BOUNDS = {
    "integer": {"minimum": -(10**MAX_INTEGER_DIGITS - 1), "maximum": 10**MAX_INTEGER_DIGITS - 1},
    "number": {
        "minimum": -float(10**MAX_INTEGER_DIGITS),
        "maximum": float(10**MAX_INTEGER_DIGITS),
        "multipleOf": 10.0**-MAX_FRACTION_DIGITS,
    },
}


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every number's digits bounded (a copy): an integer within 15 digits, a
    number within 15 digits before the point and 9 after it, where the schema says nothing of
    that bound (its own minimum, maximum or multipleOf are kept). JSON lets a number run on: a
    small model that starts repeating a digit inside a call's arguments writes it until
    max_tokens cuts the call, and the call is lost (docs/tools.md)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _walk(bounded_numbers, key, value) for key, value in schema.items()}
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    # Bounds constrain numbers only (JSON Schema), so a type list takes them as they are.
    kind = "number" if "number" in types else "integer" if "integer" in types else None
    for key, value in _NUMBER_BOUNDS.get(kind, {}).items():
        out.setdefault(key, value)
    return out


def call_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a call's arguments are generated in: the tool's, its objects closed and its
    numbers bounded."""
    return bounded_numbers(closed_objects(parameters or {"type": "object"}))


def _call_rule(index: int, tool: ToolSpec) -> str:
    head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
    parameters = call_schema(tool.parameters)
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
