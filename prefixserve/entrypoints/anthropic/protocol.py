"""Pydantic models of Anthropic's Messages API as this server takes and answers it.

Taken: `model`, `system` (a string or text blocks), `messages` (a string or content blocks:
text; `tool_use` in an assistant message, `tool_result` in a user message), `max_tokens`,
`temperature` (0-1, Anthropic's range), `top_p`, `top_k`, `stop_sequences`, `stream`,
`metadata`, `tools` (custom tools: name, description, input_schema) and `tool_choice` (auto,
any, tool, none), and `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on system
blocks, message blocks and tools, or at the top level (a breakpoint on the last block): up to
four breakpoints. Fields of the hosted service with no meaning here (`service_tier`, `speed`,
`inference_geo`, ...) are accepted and have no effect; `thinking` is taken only as
`{"type": "disabled"}` (on `count_tokens` too), and `container` and `output_config` are refused.
Content blocks of other types (images, documents) are refused with a 400 naming them, never
ignored. Unknown top-level fields are refused as Anthropic refuses them. prefixserve's extra:
`cache_report` (docs/cache_reports.md). The rules across fields (duplicate tool names, a
tool_choice naming no tool, a tool_result answering no tool_use, a schema that is not JSON
Schema) are checked in tools.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from prefixserve.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    check_schema,
)

# Anthropic sets no count of messages; the body limit bounds them, and this bounds the work of
# rendering a body of many tiny ones.
MAX_MESSAGES = 10_000
MAX_TOOLS = 128
MAX_METADATA_USER_ID_CHARS = 256
# Anthropic's rule for a custom tool's name, and a bound on the ids a history's calls carry.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,128}$"
TOOL_USE_ID_PATTERN = r"^[a-zA-Z0-9_-]{1,256}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, value: Any) -> Any:
        """A 400 that shows the allowed shape (pydantic's would name this class instead)."""
        if not isinstance(value, dict | CacheControl):
            raise ValueError(
                'cache_control must be an object, {"type": "ephemeral"} with an optional '
                '"ttl" of "5m" or "1h"'
            )
        return value


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # What the SDK may echo back from an earlier response; nothing here uses it.
    citations: list[Any] | None = None


def _text_blocks(value: Any, field: str) -> Any:
    """`field` (a string or text blocks) as text blocks: a string is one block. Text blocks are
    the field's only type, so a bad block's error points into it (`system[0].cache_control.ttl`)
    rather than at a union's first member ("Input should be a valid string"). A 400 names a
    content block type this server does not take, and what the field may be."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a string or a list of text blocks")
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" and not isinstance(block, TextBlock):
            raise ValueError(
                f"{field}[{i}] is a {kind!r} content block; this server takes text blocks "
                "only here (images and documents are not supported)"
            )
    return value


class ToolUseBlock(_Model):
    """A call the assistant made, in the history."""

    type: Literal["tool_use"]
    id: str = Field(pattern=TOOL_USE_ID_PATTERN)
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    input: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("input")
    @classmethod
    def _renderable(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Rendered as JSON text: a bounded depth, valid Unicode (the checks of a schema)."""
        try:
            check_schema(value)
        except ValueError as exc:
            raise ValueError(str(exc).replace("the schema", "the input")) from None
        return value


class ToolResultBlock(_Model):
    """What a tool answered, in the history: text (a string or text blocks)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(pattern=TOOL_USE_ID_PATTERN)
    content: list[TextBlock] = Field(default_factory=list)  # a string arrives as one text block
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_blocks(value, "content")

    def text(self) -> str:
        return "\n".join(b.text for b in self.content)


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock
_BLOCK_TYPES: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
}
# Which message may hold which blocks (Anthropic's: calls are the assistant's, results the
# user's).
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


def _content_block(value: Any) -> Any:
    """One message block, validated as the model of its `type`, so an error points into it
    (`messages[0].content[1].input`) rather than at a union member; a type this server does
    not take is a 400 naming it."""
    if isinstance(value, TextBlock | ToolUseBlock | ToolResultBlock):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    model = _BLOCK_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(
            f"a {kind!r} content block: this server takes text, tool_use and tool_result "
            "blocks (images and documents are not supported)"
        )
    return model.model_validate(value)


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    # A string arrives as one text block.
    content: list[Annotated[ContentBlock, BeforeValidator(_content_block)]] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _a_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content blocks")
        return value

    @field_validator("content")
    @classmethod
    def _blocks_of_the_role(cls, value: list[ContentBlock], info: ValidationInfo) -> Any:
        role = info.data.get("role")
        allowed = _ROLE_BLOCKS.get(role, ())
        for i, block in enumerate(value):
            if block.type not in allowed:
                raise ValueError(
                    f"content[{i}] is a {block.type!r} block, which a {role} message cannot "
                    f"hold (a {role} message takes {' and '.join(allowed)} blocks)"
                )
        return value

    def blocks(self) -> list[ContentBlock]:
        return self.content

    def text_blocks(self) -> list[TextBlock]:
        return [b for b in self.content if isinstance(b, TextBlock)]


class Tool(_Model):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None
    # Every call is held to its schema by the call grammar: strict or not, the same.
    strict: StrictBool | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_schema(value)
        if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"at most {MAX_GRAMMAR_CHARS} characters of JSON Schema")
        if value.get("type") != "object":
            raise ValueError('a tool\'s input is an object: input_schema needs "type": "object"')
        return value


class ToolChoice(_Model):
    """`{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name": ...}`, the first three
    and the last with `disable_parallel_tool_use` (none has no calls to make parallel)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=TOOL_NAME_PATTERN)
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError('tool_choice {"type": "tool"} needs the name of the tool')
        if self.type != "tool" and self.name is not None:
            raise ValueError(f'tool_choice {{"type": "{self.type}"}} takes no name')
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError('tool_choice {"type": "none"} takes no disable_parallel_tool_use')
        return self


class Metadata(_Model):
    user_id: str | None = Field(None, max_length=MAX_METADATA_USER_ID_CHARS)


class _PromptFields(_Model):
    """What makes the prompt: the fields /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: list[TextBlock] | None = None  # a string arrives as one text block
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # Anthropic's automatic caching: a breakpoint on the request's last block.
    cache_control: CacheControl | None = None
    # Refused unless off, on both routes (Anthropic's count_tokens takes it as /v1/messages
    # does): this server has no extended thinking.
    thinking: dict[str, Any] | None = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "disabled":
            raise ValueError("extended thinking is not supported by this server")
        return value

    @field_validator("system", mode="before")
    @classmethod
    def _system_text_only(cls, value: Any) -> Any:
        return None if value is None else _text_blocks(value, "system")

    def system_blocks(self) -> list[TextBlock]:
        return self.system or []


class CountTokensRequest(_PromptFields):
    pass


class MessagesRequest(_PromptFields):
    max_tokens: int = Field(ge=1)
    # Accepted and without effect here (one model, one tier of service, one place).
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = Field(None, max_length=64)
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = Field(None, max_length=256)
    workspace_id: str | None = Field(None, max_length=256)
    # Refused: this server has no containers or output formats (`thinking`: _PromptFields).
    container: Any = None
    output_config: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: StrictBool = False
    metadata: Metadata | None = None
    # prefixserve's extra: the request's cache report in the response (and the last event).
    cache_report: StrictBool = False

    @field_validator("container", "output_config")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stop_lengths(cls, value: list[str] | None) -> list[str] | None:
        for stop in value or ():
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"each stop sequence must have 1 to {MAX_STOP_STRING_CHARS} characters"
                )
        return value


# ------------------------------------------------------------------------------ responses
class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(BaseModel):
    """Anthropic's accounting: the prompt's tokens are `cache_read_input_tokens` (read from the
    cache) + `cache_creation_input_tokens` (written at the request's breakpoints) +
    `input_tokens` (the rest)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_" and 24 hex digits
    name: str
    input: dict[str, Any]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage
