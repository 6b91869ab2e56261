"""Admission control: bounded requests in flight, in all and per tenant, answered 429 with
Retry-After; a tenant's flood leaves room for the others; tickets come back however a response
ends."""

from __future__ import annotations

import time

import httpx
import pytest

from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.admission import Admission
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.errors import OpenAIError
from tests.helpers.server import KEY_ALPHA, KEY_BETA, MODEL_NAME, serve_in_thread

LONG = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
SHORT = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}


def test_a_tenant_past_its_request_share_gets_429_and_the_others_do_not():
    admission = Admission(max_requests_per_tenant=2)
    a1, a2 = admission.admit("a", 10), admission.admit("a", 10)
    with pytest.raises(OpenAIError) as info:
        admission.admit("a", 10)
    assert info.value.status_code == 429 and info.value.headers == {"Retry-After": "1"}
    admission.admit("b", 10)
    admission.release(a1)
    admission.release(a1)  # twice is once
    admission.admit("a", 10)
    assert admission.requests_of == {"a": 2, "b": 1}
    del a2


def test_token_share_refuses_only_while_the_tenant_holds_tokens():
    admission = Admission(max_tokens_per_tenant=100)
    big = admission.admit("a", 1000)  # nothing in flight: admitted whatever its size
    with pytest.raises(OpenAIError, match="tokens in flight"):
        admission.admit("a", 1)
    admission.release(big)
    assert admission.tokens_of == {} and admission.requests_of == {}
    admission.admit("a", 60)
    with pytest.raises(OpenAIError):
        admission.admit("a", 41)
    admission.admit("a", 40)


def test_the_server_wide_bound_counts_every_tenant():
    admission = Admission(max_requests=2)
    admission.admit("a", 1)
    admission.admit(None, 1)
    with pytest.raises(OpenAIError, match="the server is at its limit") as info:
        admission.admit("b", 1)
    assert "2" not in info.value.message  # nothing of the other tenants' load


@pytest.fixture(scope="module")
def tight_server(async_engine):
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add(KEY_BETA, "beta")
    admission = Admission(max_requests_per_tenant=1)
    app = build_app(async_engine, [MODEL_NAME], api_keys=keys, admission=admission)
    server, thread, url = serve_in_thread(app)
    yield url, admission
    server.should_exit = True
    thread.join(timeout=30)


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_over_http_a_tenant_at_its_share_gets_429_with_retry_after_while_another_is_served(
    tight_server,
):
    url, admission = tight_server
    with _client(url, KEY_ALPHA) as alpha, _client(url, KEY_BETA) as beta:
        with alpha.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            assert admission.requests_of == {"alpha": 1}
            refused = alpha.post("/v1/completions", json=SHORT)
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "too_many_requests"
            assert beta.post("/v1/completions", json=SHORT).status_code == 200
        # The dropped stream gives its ticket back.
        deadline = time.monotonic() + 60
        while admission.requests_of.get("alpha") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alpha.post("/v1/completions", json=SHORT).status_code == 200
    assert admission.num_requests == 0
