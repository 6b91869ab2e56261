"""OpenAI's function tools on /v1/chat/completions, as request and response models: `tools`,
`tool_choice`, assistant `tool_calls` in the history and in answers (whole and streamed).

Bounds: at most MAX_TOOLS tools, names as OpenAI allows them, each parameters schema within the
structured-output bounds (sampling_params: size, depth, valid Unicode); the cross-field rules
(duplicate names, a tool_choice naming no tool, a tool message answering no call) are checked
on the request (protocol.py `ChatCompletionRequest`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
)

from prefixserve.sampling_params import MAX_GRAMMAR_CHARS, check_schema, check_text

MAX_TOOLS = 128
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOL_CALL_ID_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        check_schema(value)
        if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"at most {MAX_GRAMMAR_CHARS} characters of JSON Schema")
        return value


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_GRAMMAR_CHARS)

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: str) -> str:
        check_text(value)
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("arguments must be a JSON object, as a string") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object, as a string")
        return value


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ------------------------------------------------------------------------------- responses
class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as OpenAI gives it: a string


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _WithoutNones(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI streams a call: a later piece of
    a call carries its index and arguments only. (The SDK's accumulator takes a `type` or `id`
    of null as the call's new value.)"""

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_WithoutNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNones):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
