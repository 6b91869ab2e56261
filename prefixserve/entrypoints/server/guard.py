"""The pure-ASGI gate in front of every route: who may call it, and how its body may arrive.

It runs before FastAPI reads a byte of the body:
- the `Authorization` header is checked first (no key or an unknown one: 401; a tenant key on an
  operator route, or an operator key on a tenant route: 403); the Messages API's routes also take
  the key as `x-api-key` (Anthropic's clients), and no other route does: there the header is no
  credential;
- `Content-Length` is parsed strictly (ASCII digits only, at most 20 of them, every copy of the
  header equal; else 400) and bounded (over `--max-request-body-bytes`: 413 at once; a body
  streamed without one is counted chunk by chunk and refused when it passes the limit);
- bodies in flight are bounded server-wide (`--max-body-bytes-in-flight`): a request's declared
  length is reserved before its body is read (a chunked body's bytes as they arrive) and released
  when its app call ends, not when the body is handed over, because FastAPI keeps the raw bytes
  (`Request._body`) and parses them (JSON, then the pydantic model, many times their size) inside
  that call; past the bound a 503 `server_busy` with `Retry-After`. A request is always admitted
  when no other body is in flight, so the bound never refuses a body the size limit allows;
- the whole body must arrive within `--timeout-request-body` seconds of the headers: past it a
  408 `request_timeout`;
- a response that starts before the request's body was read to its end carries
  `Connection: close`, so a client cannot keep the connection by trickling a body nobody reads.
Every refusal after the headers also closes the connection (draining what the client still sends
for a bounded time first: lingering_close.py). Every 4xx/5xx response is counted
into `request_errors` by status and error code, including the 500 Starlette sends for an exception
escaping the app (its outermost ServerErrorMiddleware sends it past this guard).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from prefixserve.entrypoints.server.auth import (
    ApiKeys,
    parse_basic_password,
    parse_bearer,
    parse_x_api_key,
)
from prefixserve.entrypoints.server.error_shape import anthropic_error_body, is_anthropic_path
from prefixserve.entrypoints.server.errors import RETRY_AFTER_S, OpenAIError
from prefixserve.entrypoints.server.inspector_sessions import InspectorSessions, cookie_token
from prefixserve.entrypoints.server.metrics import ServerMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health"})
# Where the error handlers leave the OpenAI error code of the response (scope["state"]).
ERROR_CODE_KEY = "error_code"
# The longest Content-Length accepted as a number (leading zeros are legal; more is a 400).
MAX_CONTENT_LENGTH_DIGITS = 20
DEFAULT_TIMEOUT_REQUEST_BODY_S = 30.0
# The default --max-body-bytes-in-flight, in bodies of the largest size allowed.
BODIES_IN_FLIGHT = 8
CLOSE = {"Connection": "close"}

# What a tenant key may call; every other path but the public ones takes an operator key (deny
# by default: a route added later is operator-only until it is listed here).
TENANT_PATHS = frozenset(
    {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)

Refusal = tuple[int, str, str]

# The routes that take the key as `x-api-key` (Anthropic's clients send it so); everywhere else
# only `Authorization` carries a credential (docs/security.md).
X_API_KEY_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def _is_operator_path(path: str) -> bool:
    return path not in TENANT_PATHS


# The inspector page (serving_cache.py): a browser sends its key as HTTP Basic, and only to these
# read-only GET routes, so a credential the browser replays on its own cannot change anything
# (no CSRF on the routes that do: they take Bearer only).
INSPECTOR_PATH = "/inspector"
BASIC_REALM = b'Basic realm="prefixserve inspector", charset="UTF-8"'
# Where _authenticate leaves whether a 401 should ask a browser for Basic credentials.
BASIC_CHALLENGE_KEY = "basic_challenge"
# Where _authenticate leaves whether an inspector route was called with the operator key (not a
# session cookie): the page load then gets a session (serving_cache.py).
KEY_LOGIN_KEY = "inspector_key_login"


def _is_browser_path(scope: Scope, path: str) -> bool:
    return scope.get("method") in ("GET", "HEAD") and (
        path == INSPECTOR_PATH or path.startswith(INSPECTOR_PATH + "/")
    )


def _route_path(scope: Scope) -> str:
    """The path the router matches: without the app's root_path (a mounted or proxied app)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


class BodyRefused(HTTPException):
    """Raised from the guarded `receive` (FastAPI re-raises an HTTPException from the body read);
    `render_refusal` turns it into an error that closes the connection."""

    def __init__(
        self, status: int, code: str, message: str, error_type: str = "invalid_request_error"
    ) -> None:
        headers = dict(CLOSE)
        if status == 503:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        super().__init__(status, message, headers=headers)
        self.code = code
        self.error_type = error_type


async def render_refusal(request: Request, exc: Exception) -> JSONResponse:
    """The exception handler of `BodyRefused` (installed by app.py): in the route's API's error
    shape (Anthropic's on the Messages API), as the refusals before the body are."""
    if not isinstance(exc, BodyRefused):
        raise exc
    request.state.error_code = exc.code
    headers = dict(exc.headers or {})
    if is_anthropic_path(_route_path(request.scope)):
        body = anthropic_error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=headers)
    err = OpenAIError(
        str(exc.detail), status_code=exc.status_code, type=exc.error_type, code=exc.code
    )
    return err.response(headers=headers)


class _Body:
    """One request's body as the guard sees it."""

    __slots__ = ("expected", "received", "reserved", "complete", "deadline", "response_started")

    def __init__(self) -> None:
        self.expected = False  # HTTP/1.1 framing announced a body (Content-Length > 0, chunked)
        self.received = 0
        self.reserved = 0
        self.complete = False  # its last message was received
        self.deadline = float("inf")
        self.response_started = False


class RequestGuard:
    """Authenticates, bounds the body, and counts errors; see the module docstring.

    Without keys (`api_keys` None) every caller is the one trusted user: tenant None, and the
    operator routes are open, as before keys existed. `timeout_request_body_s` None: no body
    timeout; `max_body_bytes_in_flight` None: no server-wide bound.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: ApiKeys | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
        timeout_request_body_s: float | None = None,
        max_body_bytes_in_flight: int | None = None,
        inspector_sessions: InspectorSessions | None = None,
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        # The inspector's browser sessions (inspector_sessions.py): its read-only routes take a
        # session cookie as well as the key.
        self.inspector_sessions = inspector_sessions
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.timeout_request_body_s = timeout_request_body_s
        self.max_body_bytes_in_flight = max_body_bytes_in_flight
        self.body_bytes_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.api_keys is not None:
            await send({"type": "websocket.close", "code": 1008})  # no route takes a websocket
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        body = _Body()
        send = self._guarded_send(scope, send, body)
        refusal = self._authenticate(scope, state)
        declared = 0
        if refusal is None:
            declared_or_refusal = self._check_content_length(scope)
            if isinstance(declared_or_refusal, tuple):
                refusal = declared_or_refusal
            else:
                declared = declared_or_refusal or 0
                body.expected = bool(declared) or _header(scope, b"transfer-encoding") is not None
        if refusal is None and not self._reserve(body, declared):
            refusal = (503, "server_busy", self._busy_message())
        if refusal is not None:
            status, code, message = refusal
            await _send_error(send, state, status, code, message, _route_path(scope))
            return
        if self.timeout_request_body_s is not None:
            body.deadline = asyncio.get_running_loop().time() + self.timeout_request_body_s
        try:
            await self.app(scope, self._bounded(receive, body), send)
        except Exception:
            # Starlette's ServerErrorMiddleware, outside this guard, answers it with a 500.
            if not body.response_started:
                self._count_error(500, "server_error")
            raise
        finally:
            self._release(body.reserved)

    def _authenticate(self, scope: Scope, state: dict[str, Any]) -> Refusal | None:
        state["tenant"] = None
        path = _route_path(scope)
        if self.api_keys is None or path in PUBLIC_PATHS:
            return None
        authorization = _header(scope, b"authorization")
        token = parse_bearer(authorization)
        if token is None and path in X_API_KEY_PATHS:
            token = parse_x_api_key(_header(scope, b"x-api-key"))
        browser = _is_browser_path(scope, path)
        if browser:
            state[BASIC_CHALLENGE_KEY] = True
            token = token or parse_basic_password(authorization)
            if token is None and self._has_session(scope):
                return None  # the inspector's session cookie: read-only routes only
        if token is None:
            return 401, "invalid_api_key", "missing API key: send 'Authorization: Bearer <key>'"
        operator = _is_operator_path(path)
        if self.api_keys.is_admin(token):
            if operator:
                state[KEY_LOGIN_KEY] = browser
                return None
            return 403, "insufficient_permissions", "an operator key cannot call this endpoint"
        tenant = self.api_keys.tenant_for(token)
        if tenant is None:
            return 401, "invalid_api_key", "invalid API key"
        if operator:
            return 403, "insufficient_permissions", "this endpoint needs an operator key"
        state["tenant"] = tenant
        return None

    def _has_session(self, scope: Scope) -> bool:
        sessions = self.inspector_sessions
        return sessions is not None and sessions.valid(cookie_token(_header(scope, b"cookie")))

    def _check_content_length(self, scope: Scope) -> int | Refusal | None:
        """The declared body length, None without the header, or the refusal of a bad one."""
        values = {v for k, v in scope.get("headers", ()) if k.lower() == b"content-length"}
        if not values:
            return None
        raw = values.pop()
        if values or not (raw.isdigit() and len(raw) <= MAX_CONTENT_LENGTH_DIGITS):
            return 400, "invalid_body", "Content-Length is not one number of at most 20 digits"
        length = int(raw)
        if length > self.max_body_bytes:
            return 413, "request_too_large", self._too_large_message()
        return length

    def _too_large_message(self) -> str:
        return (
            f"the request body is larger than {self.max_body_bytes} bytes "
            "(the server's --max-request-body-bytes)"
        )

    def _busy_message(self) -> str:
        return (
            f"the server is receiving {self.max_body_bytes_in_flight} bytes of request bodies "
            f"(its --max-body-bytes-in-flight); retry after {RETRY_AFTER_S} s"
        )

    def _reserve(self, body: _Body, nbytes: int) -> bool:
        """Add `nbytes` to the bytes in flight for `body`; False (nothing added) past the bound,
        unless nothing else is in flight."""
        cap = self.max_body_bytes_in_flight
        others = self.body_bytes_in_flight - body.reserved
        if nbytes and cap is not None and others > 0 and self.body_bytes_in_flight + nbytes > cap:
            return False
        body.reserved += nbytes
        self.body_bytes_in_flight += nbytes
        self.metrics.body_bytes_in_flight.set(self.body_bytes_in_flight)
        return True

    def _release(self, nbytes: int) -> None:
        self.body_bytes_in_flight -= nbytes
        self.metrics.body_bytes_in_flight.set(self.body_bytes_in_flight)

    def _bounded(self, receive: Receive, body: _Body) -> Receive:
        async def bounded_receive() -> Message:
            if body.complete:
                return await receive()
            message = await self._receive_in_time(receive, body)
            if message["type"] == "http.request":
                body.received += len(message.get("body", b""))
                if body.received > self.max_body_bytes:
                    raise BodyRefused(413, "request_too_large", self._too_large_message())
                grow = body.received - body.reserved
                if grow > 0 and not self._reserve(body, grow):
                    raise BodyRefused(503, "server_busy", self._busy_message(), "server_error")
                body.complete = not message.get("more_body", False)
            else:
                body.complete = True  # http.disconnect
            return message

        return bounded_receive

    async def _receive_in_time(self, receive: Receive, body: _Body) -> Message:
        if body.deadline == float("inf"):
            return await receive()
        remaining = body.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(receive(), timeout=max(remaining, 0.0))
        except TimeoutError:
            raise BodyRefused(
                408,
                "request_timeout",
                f"the request body did not arrive within {self.timeout_request_body_s:g} s "
                "(the server's --timeout-request-body)",
            ) from None

    def _guarded_send(self, scope: Scope, send: Send, body: _Body) -> Send:
        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                body.response_started = True
                if message["status"] >= 400:
                    code = scope.get("state", {}).get(ERROR_CODE_KEY) or "none"
                    self._count_error(message["status"], code)
                if body.expected and not body.complete:
                    # The rest of the body would be read and dropped by uvicorn as it comes, for
                    # as long as the client cares to send it: close after this response instead.
                    headers = list(message.get("headers", ()))
                    if not any(k.lower() == b"connection" for k, _ in headers):
                        message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return guarded_send

    def _count_error(self, status: int, code: str) -> None:
        self.metrics.request_errors.labels(status=str(status), code=code).inc()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(
    send: Send, state: dict[str, Any], status: int, code: str, message: str, path: str = ""
) -> None:
    state[ERROR_CODE_KEY] = code
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    shaped = (
        anthropic_error_body(status, message)
        if is_anthropic_path(path)
        else {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )
    body = json.dumps(shaped).encode()
    # Connection: close, so a refused client cannot keep the socket by trickling the body.
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 401:
        headers.append(
            (b"www-authenticate", BASIC_REALM if state.get(BASIC_CHALLENGE_KEY) else b"Bearer")
        )
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
