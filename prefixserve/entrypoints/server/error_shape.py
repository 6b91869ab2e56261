"""Which API's error body a route answers with: Anthropic's for the Messages API
(`{"type": "error", "error": {"type", "message"}}`), OpenAI's everywhere else. Shared by the
request guard and the app's error handlers, so a refusal before the handler (a bad key, a body
too large) has the same shape as one from it."""

from __future__ import annotations

from typing import Any

ANTHROPIC_PATH_PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (its SDK maps the status to an exception class).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
