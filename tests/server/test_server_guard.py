"""Roles, authentication before the body, the body limit, and the checks before tokenizing.

These run on a stand-in engine (asgi_helpers.py): nothing here needs the model.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from prefixserve.entrypoints.server.app import default_max_request_body_bytes
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.prompts import MAX_CHARS_PER_TOKEN
from prefixserve.lora.config import LoRASlotsBusyError
from tests.helpers.asgi import ADMIN_KEY, MAX_MODEL_LEN, TENANT_KEY, call, keys, make_app

OPERATOR_ROUTES = [
    ("GET", "/kv_events", ""),
    ("POST", "/reset_prefix_cache", "reset_running_requests=true"),
    ("GET", "/metrics", ""),
    ("GET", "/openapi.json", ""),
    ("GET", "/docs", ""),
    ("GET", "/redoc", ""),
]
TENANT_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi"}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
]


def _error(result, status: int, code: str) -> dict:
    assert result.status == status, result.body
    error = result.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


# ----------------------------------------------------------------------------------- roles
@pytest.mark.parametrize(("method", "path", "query"), OPERATOR_ROUTES)
def test_operator_endpoints_refuse_a_tenant_key_with_403(method, path, query):
    app, _ = make_app(keys())
    result = call(app, method, path, key=TENANT_KEY, query=query)
    _error(result, 403, "insufficient_permissions")


@pytest.mark.parametrize(("method", "path", "query"), OPERATOR_ROUTES)
def test_operator_endpoints_refuse_a_missing_key_with_401(method, path, query):
    app, _ = make_app(keys())
    _error(call(app, method, path, query=query), 401, "invalid_api_key")


@pytest.mark.parametrize(("method", "path", "query"), OPERATOR_ROUTES)
def test_operator_endpoints_take_the_operator_key(method, path, query):
    app, _ = make_app(keys())
    assert call(app, method, path, key=ADMIN_KEY, query=query).status == 200


@pytest.mark.parametrize(("method", "path", "body"), TENANT_ROUTES)
def test_an_operator_key_is_no_tenant_key(method, path, body):
    app, engine = make_app(keys())
    _error(call(app, method, path, key=ADMIN_KEY, body=body), 403, "insufficient_permissions")
    assert engine.tokenizer.calls == 0


@pytest.mark.parametrize(("method", "path", "query"), OPERATOR_ROUTES)
def test_without_an_operator_key_file_operator_endpoints_are_403_for_tenants(method, path, query):
    app, _ = make_app(keys(admin=False))
    _error(call(app, method, path, key=TENANT_KEY, query=query), 403, "insufficient_permissions")


@pytest.mark.parametrize(("method", "path", "query"), OPERATOR_ROUTES)
def test_without_keys_every_endpoint_stays_open(method, path, query):
    app, _ = make_app(None)
    assert call(app, method, path, query=query).status == 200


def test_a_key_in_both_key_files_is_refused(tmp_path):
    (tmp_path / "tenants").write_text("sk-same acme\n")
    (tmp_path / "ops").write_text("sk-same ops\n")
    with pytest.raises(ValueError, match="twice"):
        ApiKeys.from_options(api_key_file=tmp_path / "tenants", admin_api_key_file=tmp_path / "ops")


def test_the_admin_key_file_takes_the_api_key_file_format(tmp_path):
    (tmp_path / "ops").write_text("# operators\nsk-op ops\n\n")
    api_keys = ApiKeys.from_options(admin_api_key_file=tmp_path / "ops")
    assert api_keys is not None
    assert api_keys.is_admin("sk-op")
    assert api_keys.tenant_for("sk-op") is None
    assert len(api_keys) == 0


def test_a_bom_in_the_key_file_is_not_part_of_the_first_key(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes("sk-first acme\nsk-second acme\n".encode("utf-8-sig"))
    api_keys = ApiKeys.from_options(api_key_file=path)
    assert api_keys is not None
    assert api_keys.tenant_for("sk-first") == "acme"


# --------------------------------------------------------------------- before the body
@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_the_key_is_checked_before_the_body_is_read(key):
    app, _ = make_app(keys())
    chunks = [b"[" + b"0," * 1000, b"0]"]
    result = call(app, "POST", "/v1/completions", key=key, chunks=chunks)
    _error(result, 401, "invalid_api_key")
    assert result.chunks_read == 0


def test_a_content_length_over_the_limit_is_a_413_before_the_body_is_read():
    app, _ = make_app(keys(), max_request_body_bytes=100)
    body = {"prompt": "x" * 200}
    result = call(app, "POST", "/v1/completions", key=TENANT_KEY, body=body)
    _error(result, 413, "request_too_large")
    assert result.chunks_read == 0


def test_a_body_without_content_length_is_counted_and_refused_past_the_limit():
    app, engine = make_app(keys(), max_request_body_bytes=100)
    chunks = [b'{"prompt": "', b"x" * 60, b"x" * 60, b'"}']
    result = call(
        app, "POST", "/v1/completions", key=TENANT_KEY, chunks=chunks, content_length=False
    )
    _error(result, 413, "request_too_large")
    assert result.chunks_read == 3
    assert engine.tokenizer.calls == 0


def test_a_body_within_the_limit_passes():
    app, engine = make_app(keys(), max_request_body_bytes=1000)
    result = call(app, "POST", "/v1/completions", key=TENANT_KEY, body={"prompt": "hi"})
    assert result.status == 400  # the fake engine refuses it, after the body was read
    assert engine.tokenizer.calls == 1


def test_the_default_body_limit_fits_the_longest_legal_prompt_escaped():
    for max_model_len in (1024, 32_768, 131_072):
        longest = max_model_len * MAX_CHARS_PER_TOKEN * len("\\u1234")
        assert default_max_request_body_bytes(max_model_len) >= longest
    assert default_max_request_body_bytes(1024) == 4 << 20


# -------------------------------------------------------------------- before tokenizing
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN + 1)}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN * 32 + 1)}]},
        ),
    ],
)
def test_a_prompt_past_max_model_len_times_32_chars_is_refused_before_tokenizing(path, body):
    app, engine = make_app(keys())
    error = _error(
        call(app, "POST", path, key=TENANT_KEY, body=body), 400, "context_length_exceeded"
    )
    assert error["param"] == ("prompt" if "prompt" in body else "messages")
    assert engine.tokenizer.calls == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_in_the_prompt_is_a_400(path, body, param):
    app, engine = make_app(keys())
    result = call(app, "POST", path, key=TENANT_KEY, chunks=[body])
    assert result.status == 400, result.body
    assert result.json()["error"]["param"] == param
    assert engine.tokenizer.calls == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ],
)
def test_tokenizing_runs_off_the_event_loop_thread(path, body):
    app, engine = make_app(keys())
    call(app, "POST", path, key=TENANT_KEY, body=body)
    assert engine.tokenizer.threads
    assert threading.get_ident() not in engine.tokenizer.threads


# -------------------------------------------------------------------------- small items
def test_head_health_is_200():
    app, _ = make_app(keys())
    assert call(app, "HEAD", "/health").status == 200


def test_request_errors_are_counted_by_status_and_code():
    app, _ = make_app(keys())
    call(app, "POST", "/v1/completions", body={"prompt": "x"})
    call(app, "POST", "/v1/completions", key=TENANT_KEY, body={"prompt": "x", "top_p": 5})
    call(app, "GET", "/metrics", key=TENANT_KEY)
    text = call(app, "GET", "/metrics", key=ADMIN_KEY).body.decode()
    for line in (
        'prefixserve_request_errors_total{code="invalid_api_key",status="401"} 1.0',
        'prefixserve_request_errors_total{code="invalid_value",status="400"} 1.0',
        'prefixserve_request_errors_total{code="insufficient_permissions",status="403"} 1.0',
    ):
        assert line in text


def test_a_refused_request_closes_its_connection(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 401
        assert response.headers["connection"] == "close"


def test_a_route_not_listed_for_tenants_is_operator_only(server):
    with server.http() as http:  # a tenant key
        for path in ("/metrics/", "/no-such-route", "/docs/oauth2-redirect"):
            assert http.get(path).status_code == 403, path


def test_under_a_root_path_the_guard_checks_the_route_the_router_matches():
    from prefixserve.entrypoints.server.guard import _route_path

    assert _route_path({"path": "/api/metrics", "root_path": "/api"}) == "/metrics"
    assert _route_path({"path": "/metrics", "root_path": ""}) == "/metrics"
    assert _route_path({"path": "/api", "root_path": "/api"}) == "/"


def test_a_non_ascii_key_is_refused_when_loaded_not_silently_unmatchable():
    keys = ApiKeys()
    with pytest.raises(ValueError, match="ASCII"):
        keys.add("sk-clé", "alpha")


@pytest.mark.parametrize(
    ("query", "body", "expected"),
    [
        ("", None, (False, False)),
        ("ram_only=true", None, (False, True)),
        ("", {"ram_only": True, "reset_running_requests": True}, (True, True)),
        ("reset_running_requests=true", {"ram_only": True}, (True, True)),
    ],
)
def test_reset_prefix_cache_clears_every_tier_unless_ram_only_is_asked(query, body, expected):
    app, engine = make_app(keys())
    result = call(app, "POST", "/reset_prefix_cache", key=ADMIN_KEY, query=query, body=body)
    assert result.status == 200, result.body
    assert engine.resets == [expected]


def test_reset_prefix_cache_refuses_an_unknown_body_field():
    app, engine = make_app(keys())
    result = call(app, "POST", "/reset_prefix_cache", key=ADMIN_KEY, body={"disk": False})
    assert result.status == 400, result.body
    assert "disk" in result.json()["error"]["message"] and engine.resets == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_busy_adapter_slots_are_a_429_with_retry_after_not_a_400(path):
    app, engine = make_app(keys())
    engine.refusal = LoRASlotsBusyError("all max_loras=1 LoRA adapter slots are used")
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    result = call(app, "POST", path, key=TENANT_KEY, body=body)
    error = _error(result, 429, "lora_slots_busy")
    assert error["type"] == "rate_limit_error"
    assert int(result.headers[b"retry-after"]) >= 1
