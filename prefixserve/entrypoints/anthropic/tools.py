"""Tools on the Messages API: what a request's `tools` and `tool_choice` make of its constraint
(the call grammar: entrypoints/chat/tool_grammar.py, mapped as the OpenAI route maps its choices)
and of its answer (calls parsed out of the text by the hermes parser, as `tool_use` blocks, whole
or streamed as Anthropic streams them). The prompt side (the tool-capable template, the history
of calls and results) is render.py's.

Anthropic's rules: `tool_choice` defaults to `auto` when tools are given; `any` needs a call to
one of the tools, `tool` a call to that tool, `none` lets the model answer in text (the tools stay
in the prompt, so the prompt, and its cache, is the same whatever the choice); calls may come in
parallel unless `disable_parallel_tool_use`. `stop_reason` is `tool_use` whenever the answer
ends with calls in it, whatever the choice.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.anthropic import protocol as a
from prefixserve.entrypoints.chat.tool_grammar import (
    ToolSpec,
    auto_call_grammar,
    forced_call_grammar,
)
from prefixserve.entrypoints.chat.tool_parsers.hermes import HermesStreamParser, parse_hermes
from prefixserve.entrypoints.server.errors import OpenAIError, from_value_error
from prefixserve.sampling_params import StructuredOutputsParams

# What the engine's errors call the call grammar, as this API calls it: the tools.
GRAMMAR_FIELDS = {"structured_outputs.grammar": "tools", "structured_outputs": "tools"}

Event = tuple[str, dict[str, Any]]


@dataclass(slots=True)
class ToolPlan:
    """How one Messages request uses tools."""

    constraint: StructuredOutputsParams | None  # the call grammar (None: free text)
    parse_calls: bool  # whether answers are parsed for calls


NO_TOOLS = ToolPlan(None, False)


def check_tool_request(body: a._PromptFields) -> None:
    """The rules across fields, each an OpenAIError (a 400 in Anthropic's shape) whose message
    starts with the field: duplicate tool names, a tool_choice of `any` or `tool` without
    tools or naming none of them, an input_schema that is not valid JSON Schema, a tool_result
    answering no earlier tool_use."""
    import jsonschema

    names = [t.name for t in body.tools or ()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise OpenAIError(f"tools: duplicate tool names {duplicates}", param="tools")
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not names:
        raise OpenAIError(
            f'tool_choice: {{"type": "{choice.type}"}} needs tools', param="tool_choice"
        )
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise OpenAIError(
            f"tool_choice.name: {choice.name!r} is not one of the tools {names}",
            param="tool_choice.name",
        )
    for i, tool in enumerate(body.tools or ()):
        try:
            jsonschema.validators.validator_for(tool.input_schema).check_schema(tool.input_schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(part) for part in exc.path) or "(root)"
            param = f"tools[{i}].input_schema"
            raise OpenAIError(
                f"{param}: not a valid JSON Schema at {where}: {exc.message}", param=param
            ) from None
    _check_history(body)


def _check_history(body: a._PromptFields) -> None:
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        for j, block in enumerate(message.blocks()):
            if isinstance(block, a.ToolUseBlock):
                calls.add(block.id)
            elif isinstance(block, a.ToolResultBlock) and block.tool_use_id not in calls:
                param = f"messages[{i}].content[{j}].tool_use_id"
                raise OpenAIError(
                    f"{param}: {block.tool_use_id!r} answers no earlier tool_use block",
                    param=param,
                )


def plan_tools(body: a._PromptFields) -> ToolPlan:
    """The request's constraint and whether its answer is parsed for calls (OpenAIError 400 for
    bad tool input). The same choices as the OpenAI route's: `any` -> one or more calls to any
    tool, `tool` -> one call to it, `auto` -> text or calls, `none` -> no grammar."""
    check_tool_request(body)
    if not body.tools:
        return NO_TOOLS
    specs = [ToolSpec(t.name, t.input_schema) for t in body.tools]
    choice = body.tool_choice or a.ToolChoice(type="auto")
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "none":
        return NO_TOOLS
    if choice.type == "tool":
        grammar = forced_call_grammar([s for s in specs if s.name == choice.name], False)
    elif choice.type == "any":
        grammar = forced_call_grammar(specs, parallel)
    else:
        grammar = auto_call_grammar(specs, parallel)
    try:
        return ToolPlan(StructuredOutputsParams(grammar=grammar), True)
    except ValueError as exc:  # the tools' grammar past its bound of characters
        raise from_value_error(exc, GRAMMAR_FIELDS) from exc


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def answer_content(plan: ToolPlan, text: str) -> tuple[list[a.TextOut | a.ToolUseOut], bool]:
    """The content blocks of a finished answer, and whether it holds calls."""
    if not plan.parse_calls:
        return [a.TextOut(text=text)], False
    content, calls = parse_hermes(text)
    blocks: list[a.TextOut | a.ToolUseOut] = [] if content is None else [a.TextOut(text=content)]
    blocks += [a.ToolUseOut(id=tool_use_id(), name=c.name, input=c.arguments) for c in calls]
    return blocks or [a.TextOut(text="")], bool(calls)


def stop_reason(reason: str | None, has_calls: bool) -> str | None:
    """`tool_use` for an answer that ended (not cut at max_tokens) with calls in it."""
    return "tool_use" if has_calls and reason in ("end_turn", "stop_sequence") else reason


@dataclass(slots=True)
class StreamedBlocks:
    """One answer's text as Anthropic's content block events, in order: a text block per run of
    text, a `tool_use` block per call (opened with `input: {}`, its input as `input_json_delta`
    pieces). Without calls to parse, the answer is one text block, opened at once."""

    parser: HermesStreamParser | None  # None: the answer is text
    index: int = -1
    open: str | None = None  # the type of the open block
    num_calls: int = 0
    events: list[Event] = field(default_factory=list)

    def opening(self) -> list[Event]:
        if self.parser is None:
            self._start({"type": "text", "text": ""})
        return self._take()

    def feed(self, text: str) -> list[Event]:
        if self.parser is None:
            self._delta({"type": "text_delta", "text": text})
        else:
            self._apply(self.parser.feed(text))
        return self._take()

    def finish(self) -> list[Event]:
        """The events left once the answer ended: what the parser held, the last block's
        close (an answer with no content at all is one empty text block, as when whole)."""
        if self.parser is not None:
            self._apply(self.parser.finish())
        if self.index < 0:
            self._start({"type": "text", "text": ""})
        self._close()
        return self._take()

    def _apply(self, events: list[Any]) -> None:
        for event in events:
            if event.kind == "text":
                if self.open != "text":
                    self._start({"type": "text", "text": ""})
                self._delta({"type": "text_delta", "text": event.text})
            elif event.kind == "call_start":
                self.num_calls += 1
                block = {"type": "tool_use", "id": tool_use_id(), "name": event.name, "input": {}}
                self._start(block)
            elif event.kind == "call_arguments":
                self._delta({"type": "input_json_delta", "partial_json": event.text})

    def _start(self, block: dict[str, Any]) -> None:
        self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        self.events.append(("content_block_start", start))

    def _delta(self, delta: dict[str, Any]) -> None:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        self.events.append(("content_block_delta", event))

    def _close(self) -> None:
        if self.open is not None:
            stop = {"type": "content_block_stop", "index": self.index}
            self.events.append(("content_block_stop", stop))
            self.open = None

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out


def tool_texts(body: a._PromptFields) -> list[str]:
    """The text the tools and the history's calls and results add to the prompt (for the
    prompt's character bound, before it is rendered)."""
    texts = [
        (t.description or "") + json.dumps(t.input_schema, ensure_ascii=False)
        for t in body.tools or ()
    ]
    for message in body.messages:
        for block in message.blocks():
            if isinstance(block, a.ToolUseBlock):
                texts.append(json.dumps(block.input, ensure_ascii=False))
            elif isinstance(block, a.ToolResultBlock):
                texts.append(block.text())
    return texts
