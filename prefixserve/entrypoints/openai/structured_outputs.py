"""Structured outputs on the OpenAI routes: a request's `response_format` (OpenAI's) or
`structured_outputs` (vLLM's) as the engine's StructuredOutputsParams, with the names its errors
use for the field the client sent.

The engine compiles the constraint before it queues the request (`EngineClient.add_request`):
a constraint it cannot compile is a GrammarError, a ValueError whose message names
`structured_outputs.<kind>` (a 400: errors.from_value_error, which renames the field with the
names returned here), and a tenant with too many compiles in flight is a GrammarBusy (a 429:
server/state.py start_request). docs/structured_outputs.md describes both fields.
"""

from __future__ import annotations

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.server.errors import OpenAIError, from_value_error
from prefixserve.sampling_params import StructuredOutputsParams

# What the engine's messages call a field, as the `response_format` route calls it.
JSON_SCHEMA_NAMES = {
    "structured_outputs.json": "response_format.json_schema.schema",
    "structured_outputs": "response_format",
}
JSON_OBJECT_NAMES = {
    "structured_outputs.json": "response_format",
    "structured_outputs.json_object": "response_format",
    "structured_outputs": "response_format",
}


def structured_outputs_params(
    body: p.CompletionRequest | p.ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The constraint `body` asks for (None: none) and the names its errors give its fields.
    OpenAIError(400) when both fields constrain the answer, or the constraint is malformed
    (no kind or two, too large)."""
    response_format = body.response_format
    constrains = response_format is not None and response_format.type != "text"
    requested = body.structured_outputs
    if constrains and requested is not None:
        raise OpenAIError(
            "give response_format or structured_outputs, not both",
            param="structured_outputs",
            code="invalid_value",
        )
    if requested is not None:
        return _params(
            {},
            json=requested.json_,
            regex=requested.regex,
            choice=requested.choice,
            grammar=requested.grammar,
            json_object=requested.json_object,
            whitespace_pattern=requested.whitespace_pattern,
        ), {}
    if not constrains:
        return None, {}
    if response_format.type == "json_object":
        return _params(JSON_OBJECT_NAMES, json_object=True), JSON_OBJECT_NAMES
    assert response_format.json_schema is not None  # ResponseFormat's validator
    return _params(JSON_SCHEMA_NAMES, json=response_format.json_schema.schema_), JSON_SCHEMA_NAMES


def _params(names: dict[str, str], **fields: object) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        raise from_value_error(exc, names) from exc
