"""Pydantic models of the OpenAI-compatible API: what clients send and what the server answers.

Requests take the OpenAI fields plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `prompt_logprobs`, `cache_salt`, `stop_token_ids`), and OpenAI's prompt-caching
fields: `prompt_cache_retention` ("in_memory": the prompt's blocks never go to the disk tier;
"24h": kept there up to 24 hours) and `prompt_cache_key` (with `--replicas`, requests whose
prompts cost the same on several replicas go to the same one for the same key; one engine
ignores it). Structured outputs come as OpenAI's `response_format` (`text`, `json_object`,
`json_schema`) or vLLM's `structured_outputs` (json, regex, choice, grammar, json_object), never
both (docs/structured_outputs.md). Ranges are checked here so a
bad value comes back as a 400 naming the field; SamplingParams checks them again below the server.
Unknown fields are ignored, as OpenAI clients send fields this server has no use for, except
inside `response_format` and `structured_outputs`, where a misspelt key would silently drop the
constraint.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from prefixserve.core.kv_cache.salts import validate_cache_salt
from prefixserve.entrypoints.openai import tool_protocol as tp
from prefixserve.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    check_schema,
    check_text,
    schema_from_text,
)

MAX_PROMPT_CACHE_KEY_CHARS = 1024

# OpenAI's default for /v1/completions when max_tokens is absent or null.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# vLLM's removed top-level fields, refused with the key of `structured_outputs` that replaced them.
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)
# OpenAI's rule for `response_format.json_schema.name`.
SCHEMA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Request(BaseModel):
    # NaN and infinities (which Python's JSON parser accepts) are refused in every float field.
    # A JSON body's bool fields are StrictBool, as OpenAI's API and the offline API
    # (SamplingParams) take them: a JSON bool, never "yes", "on", 1 or 0 (a query string's
    # flags, /reset_prefix_cache's, are text: FastAPI reads those).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _StrictRequest(_Request):
    # An unknown key is a 400 naming it: ignored, a misspelt constraint would go unenforced.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_StrictRequest):
    """`response_format.json_schema`: OpenAI's named schema. `strict` is accepted and changes
    nothing: the answer always matches the schema (as vLLM does)."""

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    # Aliased: `schema` is a (deprecated) method of pydantic's BaseModel.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_schema(value)


class ResponseFormat(_StrictRequest):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (the object `json_schema` names)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _json_schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs the json_schema object')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'json_schema is for type "json_schema" only, not "{self.type}"')
        return self


class StructuredOutputsRequest(_StrictRequest):
    """vLLM's `structured_outputs`: exactly one of `json` (a JSON Schema, as an object or its
    JSON text), `regex`, `choice`, `grammar` (Lark) or `json_object`; SamplingParams'
    StructuredOutputsParams checks that and the sizes."""

    # Aliased: `json` is a (deprecated) method of pydantic's BaseModel.
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: str | None = None

    @field_validator("regex", "grammar", "whitespace_pattern")
    @classmethod
    def _check_text(cls, value: str | None) -> str | None:
        return None if value is None else check_text(value)

    @field_validator("choice")
    @classmethod
    def _check_choices(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [check_text(choice) for choice in value]

    @field_validator("json_")
    @classmethod
    def _parse_and_check(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):
            value = schema_from_text(value, "the schema")
            if not isinstance(value, dict):
                raise ValueError("must be a JSON Schema object")
        return None if value is None else check_schema(value)


class StreamOptions(_Request):
    include_usage: StrictBool = False
    # vLLM's extension: a usage object on every chunk, not only on the last one.
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Request):
    """Fields the completions and chat endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    user: str | None = None
    # vLLM extras.
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    ignore_eos: StrictBool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    cache_salt: str | None = None
    # OpenAI's prompt caching.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_key: str | None = Field(None, max_length=MAX_PROMPT_CACHE_KEY_CHARS)
    # prefixserve's extra: where the prompt's tokens came from and why the first missed block
    # missed (docs/cache_reports.md), as `cache_report` in the response or the last chunk.
    cache_report: StrictBool = False
    # Structured outputs: OpenAI's field, or vLLM's (not both: see structured_outputs.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's removed names of `structured_outputs`' keys: refused, never ignored (ignored, the
    # answer would come back unconstrained).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

    @field_validator("seed")
    @classmethod
    def _check_seed_fits_every_child(cls, value: int | None, info: ValidationInfo) -> int | None:
        # Child i samples with seed + i; `n` is declared before `seed`, so it is validated.
        n = info.data.get("n", 1)
        if value is not None and value + n - 1 > MAX_SEED:
            raise ValueError(f"seed + n - 1 must be at most 2**64 - 1 (n={n})")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(
                f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters"
            )
        return value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        validate_cache_salt(value)
        return value

    @field_validator(*GUIDED_FIELDS)
    @classmethod
    def _refuse_guided(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            key = info.field_name.removeprefix("guided_")
            raise ValueError(
                f'{info.field_name} is vLLM\'s old name: send structured_outputs={{"{key}": ...}}'
            )
        return None

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not 0 <= t <= MAX_TOKEN_ID for t in value):
            raise ValueError(f"stop token ids must be in [0, {MAX_TOKEN_ID}]")
        return value


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids, alone or as a list of one."""

    prompt: Any = None
    # vLLM's prompt embeddings: base64 of torch.save bytes of a [num_tokens, hidden] tensor, or
    # a list of one (with --enable-prompt-embeds; instead of `prompt`).
    prompt_embeds: str | list[str] | None = None
    # Absent or null: 16, as OpenAI and vLLM do (never "to the end of the context").
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if isinstance(value, str):
            return value
        if is_ids(value) and (not value or not isinstance(value[0], list)):
            return value
        if isinstance(value, list) and len(value) == 1:
            (only,) = value
            if isinstance(only, str) or is_ids(only):
                return only
        if (
            isinstance(value, list)
            and len(value) > 1
            and all(isinstance(v, str) or is_ids(v) for v in value)
        ):
            raise ValueError(
                f"this server takes one prompt per request, got a batch of {len(value)}"
            )
        raise ValueError(
            "prompt must be a string, a list of token ids, or a list holding one of these"
        )

    @field_validator("prompt_embeds")
    @classmethod
    def _one_embeds(cls, value: str | list[str] | None) -> str | None:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(
                    f"this server takes one prompt per request, got {len(value)} prompt_embeds"
                )
            return value[0]
        return value

    @field_validator("max_tokens")
    @classmethod
    def _default_max_tokens(cls, value: int | None) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if value is None else value

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of must equal n ({n}) when given")
        return value


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls (content null), and a tool turn's answer to one of them.
    tool_calls: list[tp.ToolCallIn] | None = Field(None, max_length=tp.MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=tp.MAX_TOOL_CALL_ID_CHARS)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions; the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # Function tools (tool_protocol.py; entrypoints/chat/ renders and parses them).
    tools: list[tp.ChatTool] | None = Field(None, max_length=tp.MAX_TOOLS)
    tool_choice: tp.ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


# ---------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[tp.ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[tp.DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "prefixserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
