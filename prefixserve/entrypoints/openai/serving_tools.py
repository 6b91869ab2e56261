"""Function tools on /v1/chat/completions: what a request's `tools` and `tool_choice` make of its
prompt (the tool-capable template: entrypoints/chat/tool_templates.py), of its constraint (the
call grammar: entrypoints/chat/tool_grammar.py) and of its answer (calls parsed out of the text
by the hermes parser, whole or streamed as OpenAI streams them).

OpenAI's rules: `tool_choice` defaults to "auto" when tools are given; "required" needs a call
(one, or several with `parallel_tool_calls`, the default); a named function needs that call;
"none" lets the model answer in text (the tools stay in the prompt, so the prompt, and its cache,
is the same whatever the choice). finish_reason is "tool_calls" when the answer holds calls,
except for a call forced by name, which OpenAI finishes with "stop".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from prefixserve.entrypoints.chat.tool_grammar import (
    ToolSpec,
    auto_call_grammar,
    forced_call_grammar,
)
from prefixserve.entrypoints.chat.tool_parsers.hermes import HermesStreamParser, parse_hermes
from prefixserve.entrypoints.chat.tool_templates import tool_template
from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai import tool_protocol as tp
from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses tools."""

    tools: list[dict[str, Any]] | None  # as the template renders them (None: no tools)
    template: str | None  # the chat template to render with (None: the model's own)
    constraint: StructuredOutputsParams | None  # the call grammar (None: free text)
    parse_calls: bool  # whether answers are parsed for calls
    named: bool  # a call forced by name (finish_reason "stop")


def check_tool_request(body: p.ChatCompletionRequest) -> None:
    """OpenAI's cross-field rules, each an OpenAIError (400) naming the field: duplicate tool
    names, a tool_choice without tools or naming none of them, a parameters schema that is not
    valid JSON Schema, calls outside an assistant message, a tool message answering no call."""
    import jsonschema

    names = [t.function.name for t in body.tools or ()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise OpenAIError(f"duplicate function names {duplicates}", param="tools")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not names:
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    if isinstance(choice, tp.NamedToolChoice) and choice.function.name not in names:
        raise OpenAIError(
            f"{choice.function.name!r} is not one of the tools",
            param="tool_choice.function.name",
        )
    for i, tool in enumerate(body.tools or ()):
        schema = tool.function.parameters
        if schema is None:
            continue
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(part) for part in exc.path) or "(root)"
            raise OpenAIError(
                f"not a valid JSON Schema at {where}: {exc.message}",
                param=f"tools[{i}].function.parameters",
            ) from None
    _check_history(body)


def _check_history(body: p.ChatCompletionRequest) -> None:
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        if message.tool_calls and message.role != "assistant":
            raise OpenAIError(
                "only an assistant message has tool calls", param=f"messages[{i}].tool_calls"
            )
        calls.update(call.id for call in message.tool_calls or ())
        if message.role == "tool" and message.tool_call_id not in calls:
            raise OpenAIError(
                f"{message.tool_call_id!r} answers no earlier assistant tool call",
                param=f"messages[{i}].tool_call_id",
            )


def plan_tools(body: p.ChatCompletionRequest, tokenizer: Any) -> ToolPlan:
    """The request's tools, template and constraint (OpenAIError 400 for bad tool input, or
    when the model has no template that renders tools)."""
    check_tool_request(body)
    uses_tools = bool(body.tools) or any(m.tool_calls or m.role == "tool" for m in body.messages)
    if not uses_tools:
        return ToolPlan(None, None, None, False, False)
    template = tool_template(tokenizer.hf_tokenizer, tokenizer.chat_template)
    if template is None:
        raise OpenAIError(
            "this model's chat template renders no tools and no packaged tool template fits "
            "it; start the server with --chat-template FILE",
            param="tools",
        )
    specs = [ToolSpec(t.function.name, t.function.parameters or {}) for t in body.tools or ()]
    rendered = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if specs else "none")
    parallel = body.parallel_tool_calls is not False
    if choice == "none" or not specs:
        return ToolPlan(rendered, template, None, False, False)
    if isinstance(choice, tp.NamedToolChoice):
        named = [s for s in specs if s.name == choice.function.name]
        grammar = forced_call_grammar(named, parallel=False)
        return ToolPlan(rendered, template, _constraint(grammar), True, True)
    if choice == "required":
        grammar = forced_call_grammar(specs, parallel)
    else:
        grammar = auto_call_grammar(specs, parallel)
    return ToolPlan(rendered, template, _constraint(grammar), True, False)


def _constraint(grammar: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(grammar=grammar)
    except ValueError as exc:  # the tools' grammar past the size bound
        message = str(exc).replace("structured_outputs.grammar", "the tools' call grammar")
        raise OpenAIError(message, param="tools") from None


def history_messages(body: p.ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the templates read them (assistant calls, tool results)."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["content"] = m.text() or None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in m.tool_calls
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    if has_calls and reason == "stop" and not plan.named:
        return "tool_calls"
    return reason


def answer_message(plan: ToolPlan, text: str) -> tuple[p.ChatMessageOut, bool]:
    """The assistant message of a finished answer, and whether it holds calls."""
    if not plan.parse_calls:
        return p.ChatMessageOut(content=text), False
    content, calls = parse_hermes(text)
    out = [
        tp.ToolCallOut(
            id=call_id(),
            function=tp.FunctionCallOut(name=c.name, arguments=c.arguments_json),
        )
        for c in calls
    ]
    return p.ChatMessageOut(content=content, tool_calls=out), bool(out)


@dataclass(slots=True)
class StreamedCalls:
    """One choice's streamed answer: text released as content, calls as OpenAI's deltas."""

    parser: HermesStreamParser = field(default_factory=HermesStreamParser)
    num_calls: int = 0

    def delta(self, text: str, finished: bool) -> p.DeltaMessage:
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        content = "".join(e.text for e in events if e.kind == "text")
        calls: list[tp.DeltaToolCall] = []
        for e in events:
            if e.kind == "call_start":
                self.num_calls += 1
                calls.append(
                    tp.DeltaToolCall(
                        index=e.index,
                        id=call_id(),
                        type="function",
                        function=tp.DeltaFunctionCall(name=e.name, arguments=""),
                    )
                )
            elif e.kind == "call_arguments":
                if calls and calls[-1].index == e.index:  # one entry per call in a chunk
                    calls[-1].function.arguments = (calls[-1].function.arguments or "") + e.text
                else:
                    delta = tp.DeltaFunctionCall(arguments=e.text)
                    calls.append(tp.DeltaToolCall(index=e.index, function=delta))
        return p.DeltaMessage(content=content or None, tool_calls=calls or None)
