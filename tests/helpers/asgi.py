"""Helpers for server tests that need no model: a stand-in engine and a raw ASGI call.

The raw call feeds the body in the chunks a test chooses and records how many of them the app
asked for, so a test can tell whether the app read the body at all.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from prefixserve.engine.client import EngineRequest
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys

MAX_MODEL_LEN = 64
TENANT_KEY = "sk-tenant"
ADMIN_KEY = "sk-admin"


class FakeTokenizer:
    """Counts its calls and the threads they ran on; one token per character."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: list[int] = []

    chat_template = None  # the app's tool handling asks; these tests send no tools
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.threads.append(threading.get_ident())
        return [1] * len(text)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        self.calls += 1
        self.threads.append(threading.get_ident())
        return [1] * sum(len(m["content"] or "") for m in messages)

    def apply_chat_template_text(self, messages: list[dict[str, str]], **_: Any) -> str:
        self.threads.append(threading.get_ident())
        return "".join(m["content"] or "" for m in messages)


@dataclass
class FakeEngine:
    """The parts of AsyncLLMEngine the app touches before a request reaches the engine."""

    max_model_len: int = MAX_MODEL_LEN
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    is_running: bool = True
    collect_kv_events: bool = True
    added: list[Any] = field(default_factory=list)
    resets: list[tuple[bool, bool]] = field(default_factory=list)
    refusal: Exception = ValueError("the fake engine refuses every request (max_tokens)")

    async def get_metrics(self) -> dict[str, Any]:
        return {}

    async def take_kv_events(self) -> list[Any]:
        return []

    async def reset_prefix_cache(self, reset_running_requests: bool, ram_only: bool) -> bool:
        self.resets.append((reset_running_requests, ram_only))
        return True

    async def add_request(self, request: EngineRequest) -> Any:
        self.added.append(request)
        raise self.refusal

    async def describe_pins(self) -> dict[str, Any]:
        return {"pins": {}, "pinned_blocks": 0, "capacity_blocks": 0}


class RecordingEngine(FakeEngine):
    """A FakeEngine that records the tenant of each request it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.tenants: list[Any] = []

    async def add_request(self, request: EngineRequest) -> Any:
        self.tenants.append(request.tenant)
        return await super().add_request(request)


def keys(admin: bool = True) -> ApiKeys:
    api_keys = ApiKeys()
    api_keys.add(TENANT_KEY, "tenant")
    if admin:
        api_keys.add_admin(ADMIN_KEY, "ops")
    return api_keys


def make_app(api_keys: ApiKeys | None = None, **kwargs: Any) -> tuple[Any, FakeEngine]:
    engine = FakeEngine()
    return build_app(engine, ["m"], api_keys=api_keys, **kwargs), engine  # type: ignore[arg-type]


@dataclass
class AsgiResult:
    status: int
    body: bytes
    chunks_read: int
    headers: dict[bytes, bytes] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


def call(app: Any, method: str, path: str, **kwargs: Any) -> AsgiResult:
    """One request straight into the ASGI app (`acall`'s arguments), on its own event loop."""
    return asyncio.run(acall(app, method, path, **kwargs))


async def acall(
    app: Any,
    method: str,
    path: str,
    *,
    key: str | None = None,
    body: Any = None,
    chunks: list[bytes] | None = None,
    content_length: bool = True,
    query: str = "",
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    stall: bool = False,
) -> AsgiResult:
    """One request into the ASGI app; `chunks` default to the JSON of `body`. With `stall` the
    client never sends the body's end: after `chunks`, the next read waits forever."""
    if chunks is None:
        chunks = [] if body is None else [json.dumps(body).encode()]
    all_headers = [(b"content-type", b"application/json"), *headers]
    if key is not None:
        all_headers.append((b"authorization", f"Bearer {key}".encode()))
    if content_length:
        all_headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": all_headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "app": app,
    }
    read = 0
    out: dict[str, Any] = {"body": b"", "headers": {}}

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {
                "type": "http.request",
                "body": chunks[read - 1],
                "more_body": stall or read < len(chunks),
            }
        if read == 0 and not stall:
            read = 1
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.lower(): v for k, v in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return AsgiResult(out["status"], out["body"], read, out["headers"])
