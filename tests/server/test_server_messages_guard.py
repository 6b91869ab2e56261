"""The request guard and the body rules on the Messages API's routes, over a live server: the
error shape of every refusal, which routes take `x-api-key`, and what count_tokens takes."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.server import (
    KEY_ADMIN,
    KEY_ALPHA,
    MODEL_NAME,
    serve_in_thread,
    ssl_context,
)

BODY_LIMIT = 64 << 10
ANTHROPIC_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
QUESTION = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "q"}]}


@pytest.fixture(scope="module")
def url(async_engine) -> Iterator[str]:
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add_admin(KEY_ADMIN, "ops")
    app = build_app(async_engine, [MODEL_NAME], api_keys=keys, max_request_body_bytes=BODY_LIMIT)
    server, thread, base = serve_in_thread(app)
    yield base
    server.should_exit = True
    thread.join(timeout=30)


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, verify=ssl_context())


def _oversized_body() -> bytes:
    padding = "x" * BODY_LIMIT
    return f'{{"model": "{MODEL_NAME}", "max_tokens": 1, "metadata": "{padding}"}}'.encode()


def _chunks(data: bytes, size: int = 8 << 10) -> Iterator[bytes]:
    """`data` as a body without Content-Length (httpx sends a generator chunked)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_in_anthropics_shape_however_it_is_framed(
    url, route, framing
):
    body = _oversized_body()
    content = body if framing == "content-length" else _chunks(body)
    with _http(url) as http:
        r = http.post(route, headers={"x-api-key": KEY_ALPHA}, content=content)
    assert r.status_code == 413, r.text
    assert r.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": r.json()["error"]["message"]},
    }
    assert "--max-request-body-bytes" in r.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_stays_in_openais_shape_on_the_openai_routes(url):
    with _http(url) as http:
        r = http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY_ALPHA}"},
            content=_chunks(_oversized_body()),
        )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


OPERATOR_READS = ["/metrics", "/v1/cache/summary", "/pins"]


@pytest.mark.parametrize("path", OPERATOR_READS)
def test_x_api_key_is_no_credential_on_an_operator_route(url, path):
    with _http(url) as http:
        assert http.get(path, headers={"Authorization": f"Bearer {KEY_ADMIN}"}).status_code == 200
        r = http.get(path, headers={"x-api-key": KEY_ADMIN})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_x_api_key_cannot_reset_the_prefix_cache(url):
    with _http(url) as http:
        r = http.post("/reset_prefix_cache", headers={"x-api-key": KEY_ADMIN})
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {**QUESTION, "max_tokens": 1}),
        ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "q", "max_tokens": 1}),
    ],
)
def test_x_api_key_is_no_credential_on_an_openai_tenant_route(url, method, path, body):
    with _http(url) as http:
        r = http.request(method, path, headers={"x-api-key": KEY_ALPHA}, json=body)
    assert r.status_code == 401, r.text


def _body(route: str, **extra: object) -> dict[str, object]:
    """A one-line question for `route` (count_tokens takes no max_tokens)."""
    body = {**QUESTION, **extra}
    return {**body, "max_tokens": 1} if route == "/v1/messages" else body


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES)
def test_x_api_key_is_the_key_on_the_messages_routes(url, route):
    with _http(url) as http:
        r = http.post(route, headers={"x-api-key": KEY_ALPHA}, json=_body(route))
    assert r.status_code == 200, r.text


def _count(url: str, **extra: object) -> httpx.Response:
    with _http(url) as http:
        return http.post(
            "/v1/messages/count_tokens",
            headers={"x-api-key": KEY_ALPHA},
            json={**QUESTION, **extra},
        )


def test_count_tokens_takes_thinking_disabled_as_the_messages_route_does(url):
    plain = _count(url)
    disabled = _count(url, thinking={"type": "disabled"})
    assert disabled.status_code == 200, disabled.text
    assert disabled.json() == plain.json()
    with _http(url) as http:
        r = http.post(
            "/v1/messages",
            headers={"x-api-key": KEY_ALPHA},
            json={**QUESTION, "max_tokens": 1, "thinking": {"type": "disabled"}},
        )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ANTHROPIC_ROUTES)
def test_thinking_enabled_is_refused_alike_by_count_tokens_and_the_messages_route(url, route):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with _http(url) as http:
        r = http.post(route, headers={"x-api-key": KEY_ALPHA}, json=_body(route, thinking=thinking))
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert "extended thinking is not supported" in r.json()["error"]["message"]


def _sdk(url: str, key: str = KEY_ALPHA) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url,
        api_key=key,  # the SDK sends it as x-api-key
        max_retries=0,
        timeout=120,
        http_client=anthropic.DefaultHttpxClient(verify=ssl_context()),
    )


def test_anthropics_sdk_counts_tokens_with_thinking_disabled_and_is_refused_enabled(url):
    client = _sdk(url)
    messages = QUESTION["messages"]
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=messages)
    disabled = client.messages.count_tokens(
        model=MODEL_NAME, messages=messages, thinking={"type": "disabled"}
    )
    assert disabled.input_tokens == plain.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="extended thinking"):
        client.messages.count_tokens(
            model=MODEL_NAME,
            messages=messages,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )


def test_the_operator_key_through_anthropics_sdk_is_still_no_tenant(url):
    """The operator key is a credential on the Messages routes (x-api-key), but an operator has
    no cache namespace there: 403, as over the OpenAI routes with a bearer key."""
    with pytest.raises(anthropic.PermissionDeniedError):
        _sdk(url, KEY_ADMIN).messages.count_tokens(model=MODEL_NAME, messages=QUESTION["messages"])
