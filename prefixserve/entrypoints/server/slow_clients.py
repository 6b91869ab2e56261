"""A timeout on a request's headers, which uvicorn does not have.

uvicorn's h11 protocol bounds an idle keep-alive connection (`timeout_keep_alive`) but nothing
else: a connection that sends nothing, or half its request line and headers, stays open until
the client goes away, and each one counts against `--limit-concurrency` (3,000 such connections
were all still open after 30 s). `header_timeout_protocol(seconds)` returns a subclass of
uvicorn's `H11Protocol`, passed as `http=` to `uvicorn.Config`, that closes such a connection:

- the timer starts when the connection is made, and again when the first bytes of the next
  request arrive on a kept-alive connection (the idle time between two requests stays governed
  by `timeout_keep_alive` alone);
- it stops once h11 has the whole request head (its peer state leaves IDLE: the request's
  headers are complete; the body is guard.py's to bound);
- when it fires, a client that had sent part of a request gets a `408 Request Timeout` with
  `Connection: close`, one that had sent nothing is closed silently; either way the transport is
  closed.

It builds on lingering_close.py's protocol, so the one class uvicorn is given has both.

It touches only what the subclass cannot avoid: the `conn` (h11.Connection), `transport` and
`loop` attributes and the three asyncio.Protocol callbacks, whose meaning is asyncio's.
"""

from __future__ import annotations

import asyncio

import h11

from prefixserve.entrypoints.server.lingering_close import LingeringCloseH11Protocol

DEFAULT_TIMEOUT_REQUEST_HEADERS_S = 10.0

_TIMEOUT_BODY = b"the request's headers came too slowly"
REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\n"
    b"connection: close\r\n"
    b"\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class HeaderTimeoutH11Protocol(LingeringCloseH11Protocol):
    """uvicorn's h11 protocol with a timeout on each request's headers (module docstring) and
    the lingering close of lingering_close.py."""

    timeout_request_headers_s: float = DEFAULT_TIMEOUT_REQUEST_HEADERS_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # h11 produced the Request: the headers are complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(
            self.timeout_request_headers_s, self._on_header_timeout
        )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial and self.conn.our_state is h11.IDLE:
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with a `timeout_s` header timeout."""
    if not (0 < timeout_s < float("inf")):
        raise ValueError(f"the header timeout must be a number of seconds > 0, got {timeout_s}")
    return type(
        "HeaderTimeoutH11Protocol",
        (HeaderTimeoutH11Protocol,),
        {"timeout_request_headers_s": float(timeout_s)},
    )
