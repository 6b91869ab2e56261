"""The pure-ASGI gate in front of every route: who may call it, how big its body may be.

It runs before FastAPI reads a byte of the body: the `Authorization` header is checked first
(no key or an unknown one: 401; a tenant key on an operator route, or an operator key on a
tenant route: 403), then the body is bounded (a `Content-Length` over the limit: 413 at once;
a body streamed without one is counted chunk by chunk and refused when it passes the limit).
It also counts every 4xx/5xx response into `request_errors` by status and error code.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from prefixserve.server.auth import ApiKeys, parse_bearer
from prefixserve.server.metrics import ServerMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health"})
# Where the error handlers leave the OpenAI error code of the response (scope["state"]).
ERROR_CODE_KEY = "error_code"


# What a tenant key may call; every other path but the public ones takes an operator key (deny
# by default: a route added later is operator-only until it is listed here).
TENANT_PATHS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions"})


def _is_operator_path(path: str) -> bool:
    return path not in TENANT_PATHS


def _route_path(scope: Scope) -> str:
    """The path the router matches: without the app's root_path (a mounted or proxied app)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


class RequestGuard:
    """Authenticates, bounds the body, and counts errors; see the module docstring.

    Without keys (`api_keys` None) every caller is the one trusted user: tenant None, and the
    operator routes are open, as before keys existed.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: ApiKeys | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.api_keys is not None:
            await send({"type": "websocket.close", "code": 1008})  # no route takes a websocket
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        send = self._counting(scope, send)
        refusal = self._authenticate(scope, state)
        if refusal is None:
            refusal = self._check_content_length(scope)
        if refusal is not None:
            status, code, message = refusal
            await _send_error(send, state, status, code, message)
            return
        await self.app(scope, self._bounded(receive), send)

    def _authenticate(self, scope: Scope, state: dict[str, Any]) -> tuple[int, str, str] | None:
        state["tenant"] = None
        path = _route_path(scope)
        if self.api_keys is None or path in PUBLIC_PATHS:
            return None
        token = parse_bearer(_header(scope, b"authorization"))
        if token is None:
            return 401, "invalid_api_key", "missing API key: send 'Authorization: Bearer <key>'"
        operator = _is_operator_path(path)
        if self.api_keys.is_admin(token):
            if operator:
                return None
            return 403, "insufficient_permissions", "an operator key cannot call this endpoint"
        tenant = self.api_keys.tenant_for(token)
        if tenant is None:
            return 401, "invalid_api_key", "invalid API key"
        if operator:
            return 403, "insufficient_permissions", "this endpoint needs an operator key"
        state["tenant"] = tenant
        return None

    def _check_content_length(self, scope: Scope) -> tuple[int, str, str] | None:
        raw = _header(scope, b"content-length")
        if raw is None:
            return None
        try:
            length = int(raw)
        except ValueError:
            return 400, "invalid_body", "Content-Length is not an integer"
        if length > self.max_body_bytes:
            return 413, "request_too_large", self._too_large_message()
        return None

    def _too_large_message(self) -> str:
        return (
            f"the request body is larger than {self.max_body_bytes} bytes "
            "(the server's --max-request-body-bytes)"
        )

    def _bounded(self, receive: Receive) -> Receive:
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI re-raises an HTTPException from the body read; the error handlers
                    # render it as an OpenAI error.
                    raise HTTPException(413, self._too_large_message())
            return message

        return bounded_receive

    def _counting(self, scope: Scope, send: Send) -> Send:
        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                code = scope.get("state", {}).get(ERROR_CODE_KEY) or "none"
                self.metrics.request_errors.labels(status=str(message["status"]), code=code).inc()
            await send(message)

        return counting_send


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(
    send: Send, state: dict[str, Any], status: int, code: str, message: str
) -> None:
    state[ERROR_CODE_KEY] = code
    error_type = "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    # Connection: close, so a refused client cannot keep the socket by trickling the body.
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
