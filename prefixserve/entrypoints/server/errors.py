"""OpenAI-style errors: every failure leaves as `{"error": {message, type, param, code}}`.

Handlers raise `OpenAIError` for anything a client caused; the exception handlers installed by
`install_error_handlers` also turn FastAPI's validation errors (bad JSON, wrong types), unknown
routes and unexpected exceptions into the same body, so a client never sees another shape.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.engine.exceptions import NotSupportedByEngine
from prefixserve.entrypoints.server.error_shape import anthropic_error_body, is_anthropic_path
from prefixserve.lora.config import LoRASlotsBusyError
from prefixserve.structured_output.errors import GrammarError

logger = logging.getLogger(__name__)

# Seconds a capacity refusal (a 429 or 503) asks the client to wait before retrying.
RETRY_AFTER_S = 1

# Fields a ValueError from SamplingParams or the engine may name in its first words; used to fill
# `param` when the error comes from below the server.
KNOWN_PARAMS = (
    "prompt_embeds",
    "prompt_token_ids",
    "prompt_logprobs",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "stop",
    "logprobs",
    "top_logprobs",
    "cache_salt",
    "structured_outputs",
)

# A structured-output error names its field as `structured_outputs.<kind>` (the engine's words).
_STRUCTURED_FIELD = re.compile(r"\bstructured_outputs(\.[a-z_]+)?")
# The OpenAI error code of each reason a grammar is refused for (GrammarError.reason).
GRAMMAR_ERROR_CODES = {
    "invalid_schema": "invalid_schema",
    "unsupported": "unsupported_schema",
    "invalid_grammar": "invalid_grammar",
    "timeout": "grammar_compile_timeout",
}


class OpenAIError(Exception):
    """An error the client caused (or the server, for 5xx), rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field is called "type"
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = {**(self.headers or {}), **(headers or {})} or None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def param_from_message(message: str) -> str | None:
    """The request field a ValueError message names first (`"top_p must be ..."` -> `"top_p"`)."""
    lowered = message.lower()
    best: tuple[int, str] | None = None
    for name in KNOWN_PARAMS:
        pos = _find_word(lowered, name)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, name)
    return None if best is None else best[1]


def _find_word(text: str, word: str) -> int:
    start = 0
    while (pos := text.find(word, start)) >= 0:
        before = text[pos - 1] if pos > 0 else " "
        end = pos + len(word)
        after = text[end] if end < len(text) else " "
        if not (before.isalnum() or before == "_") and not (after.isalnum() or after == "_"):
            return pos
        start = pos + 1
    return -1


# What the engine calls a request field, as the API calls it.
_ENGINE_FIELD_NAMES = {"prompt_token_ids": "prompt"}


def from_value_error(exc: ValueError, fields: Mapping[str, str] | None = None) -> OpenAIError:
    """A ValueError raised by SamplingParams or the engine's validation, as a 400 (busy adapter
    slots, a capacity refusal: a 429 with Retry-After).

    `param` is the field the message names first, in the API's words; `fields` renames it to
    what the endpoint calls that field (chat sends its prompt as `messages`). The engine names
    `max_model_len` only when the request does not fit the context, which OpenAI reports with the
    code `context_length_exceeded`. A structured-output field keeps its key
    (`structured_outputs.regex`) and, renamed (`response_format.json_schema.schema`), is renamed
    in the message too; a grammar the engine refused has its reason's code.
    """
    message = str(exc)
    if isinstance(exc, LoRASlotsBusyError):
        return capacity_refusal(message, "lora_slots_busy")
    param = param_from_message(message)
    param = _ENGINE_FIELD_NAMES.get(param, param) if param is not None else None
    if param == "structured_outputs":
        param, message = _structured_field(message, fields or {})
    elif param is not None and fields:
        param = fields.get(param, param)
    code = "context_length_exceeded" if _find_word(message.lower(), "max_model_len") >= 0 else None
    if isinstance(exc, GrammarError):
        code = GRAMMAR_ERROR_CODES.get(exc.reason, code)
    return OpenAIError(message, param=param, code=code)


def _structured_field(message: str, fields: Mapping[str, str]) -> tuple[str, str]:
    """The structured-output field `message` names first, and the message, both in the
    endpoint's words (`fields`)."""
    found = _STRUCTURED_FIELD.search(message)
    assert found is not None  # param_from_message found the word
    named = found.group(0)
    param = fields.get(named, named)
    if param != named:
        message = message[: found.start()] + param + message[found.end() :]
    return param, message


# Tags pydantic puts into an error location for the member of a union that failed.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in _UNION_TAGS:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 (bad JSON, wrong types, values out of range) as an OpenAI 400."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(
            f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json"
        )
    if first.get("type") == "model_attributes_type" or tuple(first.get("loc", ())) == ("body",):
        return OpenAIError("the request body must be a JSON object", code="invalid_body")
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    value = first.get("input")
    shown = "" if param is None or isinstance(value, dict) else f" (got {_short(value)})"
    message = f"{param}: {msg}{shown}" if param else msg
    return OpenAIError(message, param=param, code="invalid_value")


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise into the OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code
        )
        err = OpenAIError(
            str(exc.detail), status_code=exc.status_code, type="invalid_request_error", code=code
        )
        return _respond(request, err, headers=getattr(exc, "headers", None))

    @app.exception_handler(NotSupportedByEngine)
    async def _not_supported(request: Request, exc: NotSupportedByEngine) -> JSONResponse:
        return _respond(request, OpenAIError(str(exc), status_code=501, code="not_supported"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = OpenAIError(
            f"internal server error: {type(exc).__name__}",
            status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            type="server_error",
        )
        return _respond(request, err)


def _respond(
    request: Request, err: OpenAIError, headers: dict[str, str] | None = None
) -> JSONResponse:
    # The request guard (guard.py) counts the response under this code.
    request.state.error_code = err.code or err.type
    if is_anthropic_path(request.url.path):
        headers = {**(err.headers or {}), **(headers or {})} or None
        body = anthropic_error_body(err.status_code, err.message)
        return JSONResponse(body, status_code=err.status_code, headers=headers)
    return err.response(headers=headers)


def capacity_refusal(message: str, code: str) -> OpenAIError:
    """A 429 with Retry-After: the server cannot take this now, but will when load passes
    (OpenAI's clients retry it by themselves)."""
    return OpenAIError(
        f"{message}; retry after {RETRY_AFTER_S} s",
        status_code=429,
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def engine_stopped() -> OpenAIError:
    """The 503 of every request once the engine's step loop died. Not the engine's own error
    text, which may name another request's data (the server's log has it)."""
    return OpenAIError(
        "the engine has stopped; the server is restarting", status_code=503, type="server_error"
    )


def request_failed(error: str | None) -> OpenAIError:
    """A failure of one request alone (the engine served the others on), naming its cause."""
    return OpenAIError(
        f"the request failed: {error}", status_code=500, type="server_error", code="request_failed"
    )
