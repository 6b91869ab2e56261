"""The request guard's bounds on bodies in time and in bytes, its Content-Length parsing, its
error counting, and what /v1/models tells a tenant. ASGI calls on a stand-in engine
(asgi_helpers.py); the same over real sockets is in test_server_slow_clients.py.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from prefixserve import cli
from tests.helpers.asgi import ADMIN_KEY, TENANT_KEY, acall, call, keys, make_app

WAIT_S = 10.0


def _error(result, status: int, code: str) -> dict:
    assert result.status == status, result.body
    error = result.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


def _in_flight(app) -> float:
    metrics = app.state.server.metrics
    return metrics.registry.get_sample_value("prefixserve_request_body_bytes_in_flight")


def _length(n: int) -> list[tuple[bytes, bytes]]:
    return [(b"content-length", str(n).encode())]


def _post(app, n: int, *, stall: bool = False, chunked: bool = False, key: str = TENANT_KEY):
    """A completions request of an `n`-byte body (a coroutine); `stall`: its end never comes."""
    valid = b'{"prompt": "x"}'
    chunks = [valid + b" " * (n - len(valid))] if not stall else [b"{" + b" " * (n - 1)]
    headers = [(b"transfer-encoding", b"chunked")] if chunked else _length(n)
    return acall(
        app,
        "POST",
        "/v1/completions",
        key=key,
        chunks=chunks,
        content_length=False,
        headers=headers,
        stall=stall,
    )


# -------------------------------------------------------------------------- body timeout
def test_a_body_that_does_not_arrive_in_time_gets_a_408_that_closes_the_connection():
    app, engine = make_app(keys(), timeout_request_body_s=0.5)

    async def run():
        return await asyncio.wait_for(_post(app, 100, stall=True), WAIT_S)

    result = asyncio.run(run())
    error = _error(result, 408, "request_timeout")
    assert "--timeout-request-body" in error["message"]
    assert result.headers[b"connection"] == b"close"
    assert engine.tokenizer.calls == 0
    assert _in_flight(app) == 0  # its 100 bytes released with the 408
    text = call(app, "GET", "/metrics", key=ADMIN_KEY).body.decode()
    assert 'prefixserve_request_errors_total{code="request_timeout",status="408"} 1.0' in text


def test_a_response_sent_before_the_body_ended_closes_the_connection():
    app, _ = make_app(keys())
    stalled = call(
        app,
        "GET",
        "/v1/models",
        key=TENANT_KEY,
        chunks=[b"x" * 10],
        content_length=False,
        headers=_length(1000),
        stall=True,
    )
    assert stalled.status == 200
    assert stalled.headers[b"connection"] == b"close"
    plain = call(app, "GET", "/v1/models", key=TENANT_KEY)
    assert plain.status == 200
    assert b"connection" not in plain.headers


# ------------------------------------------------------------- body bytes in flight
def test_bodies_in_flight_past_the_server_bound_get_a_503_with_retry_after():
    app, engine = make_app(keys(), max_request_body_bytes=800, max_body_bytes_in_flight=1000)

    async def run():
        slow = asyncio.create_task(_post(app, 600, stall=True))  # holds 600 until cancelled
        while _in_flight(app) != 600:
            await asyncio.sleep(0.01)
        refused = await _post(app, 600)
        admitted = await _post(app, 300)  # 900 <= 1000
        assert _in_flight(app) == 600
        slow.cancel()  # the client went away
        await asyncio.gather(slow, return_exceptions=True)
        assert _in_flight(app) == 0
        after = await _post(app, 600)
        return refused, admitted, after

    refused, admitted, after = asyncio.run(run())
    error = _error(refused, 503, "server_busy")
    assert "--max-body-bytes-in-flight" in error["message"]
    assert refused.headers[b"retry-after"] == b"1"
    assert refused.headers[b"connection"] == b"close"
    assert refused.chunks_read == 0
    assert admitted.status == after.status == 400  # the stand-in engine's refusal: it got in
    assert engine.tokenizer.calls == 2


def test_a_chunked_body_is_counted_as_it_arrives():
    app, _ = make_app(keys(), max_request_body_bytes=800, max_body_bytes_in_flight=1000)

    async def run():
        slow = asyncio.create_task(_post(app, 600, stall=True, chunked=True))
        while _in_flight(app) != 600:
            await asyncio.sleep(0.01)
        refused = await _post(app, 600, chunked=True)
        slow.cancel()
        return refused

    refused = asyncio.run(run())
    _error(refused, 503, "server_busy")
    assert refused.chunks_read == 1  # refused when its bytes arrived, not before


def test_a_body_is_held_until_its_app_call_ends_not_only_while_it_arrives():
    app, _ = make_app(None, max_body_bytes_in_flight=1000)
    release = asyncio.Event()

    async def slow(request: Request) -> dict:
        await request.body()  # the body handed over; the handler still holds it
        await release.wait()
        return {}

    app.add_api_route("/slow", slow, methods=["POST"])

    async def run():
        task = asyncio.create_task(acall(app, "POST", "/slow", chunks=[b"x" * 700]))
        while _in_flight(app) != 700:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        held = _in_flight(app)
        refused = await acall(app, "POST", "/slow", chunks=[b"y" * 700])
        release.set()
        done = await asyncio.wait_for(task, WAIT_S)
        return held, refused, done

    held, refused, done = asyncio.run(run())
    assert held == 700
    assert refused.status == 503
    assert done.status == 200
    assert _in_flight(app) == 0


def test_a_lone_body_is_admitted_whatever_the_bound_and_bodiless_requests_always_are():
    app, _ = make_app(keys(), max_request_body_bytes=800, max_body_bytes_in_flight=100)

    async def run():
        slow = asyncio.create_task(_post(app, 500, stall=True))
        while _in_flight(app) != 500:
            await asyncio.sleep(0.01)
        models = await acall(app, "GET", "/v1/models", key=TENANT_KEY)
        slow.cancel()
        return models

    assert asyncio.run(run()).status == 200
    assert asyncio.run(_post(app, 500)).status == 400  # the stand-in engine's refusal


@pytest.mark.parametrize(("bound", "admitted"), [(None, 8), (0, 20)])
def test_the_in_flight_bound_defaults_to_eight_bodies_and_zero_turns_it_off(bound, admitted):
    app, _ = make_app(keys(), max_request_body_bytes=100, max_body_bytes_in_flight=bound)

    async def run():
        slow = [asyncio.create_task(_post(app, 100, stall=True)) for _ in range(20)]
        while len([t for t in slow if t.done()]) + _in_flight(app) / 100 < 20:
            await asyncio.sleep(0.01)
        held = _in_flight(app)
        refused = [t.result() for t in slow if t.done()]
        for task in slow:
            task.cancel()
        return held, refused

    held, refused = asyncio.run(run())
    assert held == admitted * 100
    assert [r.status for r in refused] == [503] * (20 - admitted)
    assert _in_flight(app) == 0
    assert cli.build_parser().parse_args(["serve"]).max_body_bytes_in_flight is None


# -------------------------------------------------------------------- Content-Length
@pytest.mark.parametrize(
    "values",
    [[b"+5"], [b" 5"], [b"5 "], [b"5_0"], [b"0x10"], [b"1e3"], [b"-1"], [b""], [b"\xd9\xa3"]]
    + [[b"9" * 21], [b"5", b"6"]],
)
def test_a_content_length_that_is_not_one_plain_number_is_a_400(values):
    app, engine = make_app(keys())
    headers = [(b"content-length", v) for v in values]
    result = call(
        app,
        "POST",
        "/v1/completions",
        key=TENANT_KEY,
        chunks=[b'{"prompt": "x"}'],
        content_length=False,
        headers=headers,
    )
    _error(result, 400, "invalid_body")
    assert result.chunks_read == 0
    assert engine.tokenizer.calls == 0


def test_a_content_length_with_leading_zeros_or_repeated_is_a_number():
    app, _ = make_app(keys())
    body = b'{"prompt": "x"}'
    n = str(len(body)).encode()
    for headers in ([(b"content-length", b"000" + n)], [(b"content-length", n)] * 2):
        result = call(
            app,
            "POST",
            "/v1/completions",
            key=TENANT_KEY,
            chunks=[body],
            content_length=False,
            headers=headers,
        )
        assert result.status == 400 and result.json()["error"]["param"] == "max_tokens"


# ----------------------------------------------------------------------- 5xx counting
def test_an_exception_escaping_the_app_is_counted_as_a_500():
    app, _ = make_app(keys())

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom, methods=["GET"])
    client = TestClient(app, raise_server_exceptions=False)
    response = client.get("/boom", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    text = call(app, "GET", "/metrics", key=ADMIN_KEY).body.decode()
    assert 'prefixserve_request_errors_total{code="server_error",status="500"} 1.0' in text


# ------------------------------------------------------------------------- /v1/models
def test_v1_models_names_the_served_model_never_a_path():
    app, _ = make_app(keys())
    cards = call(app, "GET", "/v1/models", key=TENANT_KEY).json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("m", "m")]


@pytest.mark.parametrize(
    ("model", "name"),
    [("/srv/secret/weights/My-Model", "My-Model"), ("/srv/w/My-Model/", "My-Model"), ("x", "x")]
    + [("/srv/gguf/tiny.Q4_K_M.gguf", "tiny.Q4_K_M.gguf")],
)
def test_the_default_served_name_of_a_path_is_its_last_part(model, name):
    assert cli.default_served_name(model) == name
