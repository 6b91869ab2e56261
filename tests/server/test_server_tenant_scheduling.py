"""The server tells the engine which tenant each request is for, so the scheduler can share steps
and the waiting queue fairly (the rules themselves are pinned in tests/test_fair_share.py)."""

from __future__ import annotations

from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.asgi import RecordingEngine, call


def test_each_request_reaches_the_engine_with_its_keys_tenant():
    keys = ApiKeys()
    keys.add("sk-a", "alice")
    keys.add("sk-b", "bob")
    engine = RecordingEngine()
    app = build_app(engine, ["m"], api_keys=keys)  # type: ignore[arg-type]
    for key in ("sk-a", "sk-b"):
        call(app, "POST", "/v1/completions", key=key, body={"model": "m", "prompt": "hi"})
    call(
        app,
        "POST",
        "/v1/chat/completions",
        key="sk-a",
        body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert engine.tenants == ["alice", "bob", "alice"]


def test_without_keys_every_request_is_the_one_tenant():
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    call(app, "POST", "/v1/completions", body={"model": "m", "prompt": "hi"})
    assert engine.tenants == [None]
