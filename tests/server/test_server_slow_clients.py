"""Slow and idle clients against a real uvicorn server, over raw sockets.

The header timeout (slow_clients.py), the body timeout and the close after an unread body
(guard.py), and the keep-alive timeout left as it was. The app is the real one on a stand-in
engine (asgi_helpers.py). Timeouts are 1 s and each close is awaited for up to 10 s.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from prefixserve.entrypoints.server.slow_clients import header_timeout_protocol
from tests.helpers.asgi import TENANT_KEY, keys, make_app
from tests.helpers.server import serve_in_thread

WAIT_S = 10.0  # generous: every timeout under test is 1 s
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@contextmanager
def serving(
    header_timeout_s: float = 1.0, keep_alive_s: int = 30, body_timeout_s: float = 30.0
) -> Iterator[tuple[str, int]]:
    app, _ = make_app(keys(), timeout_request_body_s=body_timeout_s)
    server, thread, url = serve_in_thread(
        app, http=header_timeout_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s
    )
    host, port = url.removeprefix("http://").split(":")
    try:
        yield host, int(port)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: status, headers (lower-case names), body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict((k.strip().lower(), v.strip()) for k, v in (x.split(":", 1) for x in lines[1:]))
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return status, headers, body


def closed_within(sock: socket.socket, seconds: float = WAIT_S) -> bytes:
    """What the server sent before closing; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    data = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    except TimeoutError:
        pass
    raise AssertionError(f"still open after {seconds} s (received {data!r})")


# ----------------------------------------------------------------------------- headers
def test_connections_that_sent_half_their_headers_get_a_408_and_are_closed():
    with serving(header_timeout_s=1.0) as address:
        socks = [connect(address) for _ in range(100)]
        try:
            for sock in socks:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            for sock in socks:
                data = closed_within(sock)
                assert data.startswith(b"HTTP/1.1 408 "), data
                assert b"connection: close" in data.lower()
        finally:
            for sock in socks:
                sock.close()


def test_a_connection_that_sends_nothing_is_closed_without_a_response():
    with serving(header_timeout_s=1.0) as address, connect(address) as sock:
        assert closed_within(sock) == b""


def test_a_normal_request_and_a_later_one_on_the_same_connection_work():
    with serving(header_timeout_s=1.0) as address, connect(address) as sock:
        sock.sendall(HEALTH)
        status, headers, body = read_response(sock)
        assert status == 200, body
        assert headers.get("connection") != "close"
        time.sleep(2.5)  # idle past the header timeout: keep-alive (30 s) governs this time
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200


def test_the_header_timeout_restarts_with_each_request_on_a_kept_alive_connection():
    with serving(header_timeout_s=1.0, keep_alive_s=30) as address, connect(address) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert closed_within(sock).startswith(b"HTTP/1.1 408 ")


def test_an_idle_kept_alive_connection_is_still_closed_by_the_keep_alive_timeout():
    with serving(header_timeout_s=60.0, keep_alive_s=1) as address, connect(address) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        assert closed_within(sock) == b""


def test_the_header_timeout_must_be_positive():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="header timeout"):
            header_timeout_protocol(bad)


# -------------------------------------------------------------------------------- body
def _post_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TENANT_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_a_body_trickling_past_the_body_timeout_gets_a_408_and_the_connection_closes():
    with serving(body_timeout_s=1.0) as address, connect(address) as sock:
        sock.sendall(_post_head("/v1/completions", 100) + b'{"prompt": "')
        status, headers, body = read_response(sock)
        assert status == 408, body
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout"
        assert set(error) == {"message", "type", "param", "code"}
        closed_within(sock)


def test_a_body_the_route_never_reads_does_not_keep_the_connection():
    # /v1/models answers without reading the body; the rest of it would otherwise be read and
    # dropped for as long as the client sends it, the connection kept past the keep-alive time.
    with serving() as address, connect(address) as sock:
        head = (
            f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TENANT_KEY}\r\n"
            "Content-Length: 1000\r\n\r\n"
        ).encode()
        sock.sendall(head + b"x" * 10)
        status, headers, _ = read_response(sock)
        assert status == 200
        assert headers["connection"] == "close"
        closed_within(sock)


# --------------------------------------------------------------------- lingering close
def _refused_upload(address: tuple[str, int], length: int) -> socket.socket:
    """A connection whose upload of `length` bytes was refused after its headers (a wrong key):
    the 401 read, the body not yet sent."""
    sock = connect(address)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    sock.sendall(head)
    status, headers, _ = read_response(sock)
    assert (status, headers["connection"]) == (401, "close")
    return sock


def _send_until_refused(sock: socket.socket, seconds: float, chunk: bytes) -> float | None:
    """Sends `chunk` every 50 ms for `seconds`; the time the connection refused more (reset or
    closed), or None if every send went through."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(chunk)
        except OSError:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def test_a_refused_client_may_finish_sending_its_body_and_is_not_reset(monkeypatch):
    # Closing at once with the body still coming resets the connection, and a reset discards
    # what the kernel had not yet sent of the refusal: the client read `Connection reset by
    # peer` instead of the 401 (make test, loaded host). The server drains instead.
    monkeypatch.setattr("prefixserve.entrypoints.server.lingering_close.LINGER_S", 30.0)
    with serving() as address:
        sock = _refused_upload(address, 1_000_000)
        with sock:
            assert _send_until_refused(sock, 1.0, b"x" * 50_000) is None  # 20 sends, ~1 MB
            assert closed_within(sock) == b""  # the FIN after the 401, nothing more


def test_a_client_that_closes_ends_the_linger_at_once(monkeypatch):
    monkeypatch.setattr("prefixserve.entrypoints.server.lingering_close.LINGER_S", 60.0)
    app, _ = make_app(keys())
    server, thread, url = serve_in_thread(app, http=header_timeout_protocol(10.0))
    host, port = url.removeprefix("http://").split(":")
    try:
        _refused_upload((host, int(port)), 1_000_000).close()
        deadline = time.monotonic() + WAIT_S
        while server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.server_state.connections  # well before the 60 s linger
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.parametrize("bound", ["time", "bytes"])
def test_a_refused_client_that_never_stops_sending_is_closed_at_the_linger_bound(
    monkeypatch, bound
):
    module = "prefixserve.entrypoints.server.lingering_close"
    monkeypatch.setattr(f"{module}.LINGER_S", 1.0 if bound == "time" else 60.0)
    monkeypatch.setattr(f"{module}.LINGER_IDLE_S", 60.0)
    monkeypatch.setattr(f"{module}.LINGER_BYTES", 1 << 40 if bound == "time" else 200_000)
    with serving() as address, _refused_upload(address, 10**12) as sock:
        assert _send_until_refused(sock, WAIT_S, b"x" * 10_000) is not None


def test_a_refused_client_that_goes_quiet_is_closed_after_the_idle_time(monkeypatch):
    module = "prefixserve.entrypoints.server.lingering_close"
    monkeypatch.setattr(f"{module}.LINGER_S", 60.0)
    monkeypatch.setattr(f"{module}.LINGER_IDLE_S", 0.5)
    with serving() as address, _refused_upload(address, 1_000_000) as sock:
        assert _send_until_refused(sock, 1.0, b"x" * 10_000) is None  # each send restarts it
        time.sleep(1.5)  # quiet past the idle time: closed (its FIN came after the 401)
        assert _send_until_refused(sock, WAIT_S, b"x") is not None  # well before 60 s
