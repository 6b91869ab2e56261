"""A lingering close: the response to a request whose body was not read reaches its client.

Every refusal after the headers (guard.py: a bad key, a body too large or too slow) and every
answer that leaves the body unread closes the connection (`Connection: close`). uvicorn closes it
at once, often while the client is still sending that body. A TCP socket closed with unread bytes
in its receive buffer, or bytes arriving after the close, is reset, and a reset also discards what
the server had written but the kernel had not yet sent: the client sees `Connection reset by
peer` where the 401 or 413 should be (seen in `make test` on a loaded host, with the response's
headers read and its body lost).

`LingeringCloseH11Protocol` closes such a connection as nginx's `lingering_close` does:
- when the response is done and the request's body has not all arrived (h11's peer state is still
  SEND_BODY), it sends its FIN after the response (`write_eof`; a TLS transport has no half-close
  and sends nothing more), resumes reading if flow control had paused it, and reads and drops
  whatever the client still sends;
- it closes when the client closes its side, when nothing has come for `LINGER_IDLE_S`
  seconds, `LINGER_S` seconds after the response, or once `LINGER_BYTES` have been dropped,
  whichever comes first (nginx's `lingering_timeout` and `lingering_time`, 5 s and 30 s, and a
  bound on the bytes read for nothing): a client that never stops sending holds the connection
  no longer than the body timeout would have let it;
- any other close (the body complete, an idle keep-alive, the header timeout, a second close) is
  immediate, as before.

It touches only the `transport` attribute the protocol and its request cycles close through (a
thin proxy whose `close` comes here), `conn`'s peer state, and asyncio's transport and protocol
callbacks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 30.0
LINGER_IDLE_S = 5.0
LINGER_BYTES = 64 * 1024 * 1024


class _ClosesThroughProtocol:
    """The connection's transport, except that `close` asks the protocol how to close."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringCloseH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_connection()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LingeringCloseH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a lingering close (module docstring)."""

    _raw_transport: asyncio.Transport
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_deadline: float = 0.0  # the loop time LINGER_S after the response
    _lingered_bytes: int = -1  # -1: not lingering

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._raw_transport = transport  # type: ignore[assignment]
        self.transport = _ClosesThroughProtocol(self._raw_transport, self)  # type: ignore[assignment]

    @property
    def lingering(self) -> bool:
        return self._lingered_bytes >= 0

    def close_connection(self) -> None:
        """The close the protocol and its request cycles ask for: lingering when the request's
        body is still on its way, else at once."""
        raw = self._raw_transport
        if self.lingering or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            self._close_now()
            return
        self._lingered_bytes = 0
        self._linger_deadline = self.loop.time() + LINGER_S
        raw.resume_reading()
        if raw.can_write_eof():
            raw.write_eof()  # sent once the response already written has gone
        self._arm_linger_timer()

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)
            return
        self._lingered_bytes += len(data)
        if self._lingered_bytes >= LINGER_BYTES:
            self._close_now()
        else:
            self._arm_linger_timer()  # LINGER_IDLE_S from this data, within the deadline

    def eof_received(self) -> bool | None:
        if self.lingering:
            self._close_now()  # the client has closed its side: nothing more to drain
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_linger_timer()
        super().connection_lost(exc)

    def _close_now(self) -> None:
        self._cancel_linger_timer()
        self._raw_transport.close()

    def _arm_linger_timer(self) -> None:
        self._cancel_linger_timer()
        when = min(self.loop.time() + LINGER_IDLE_S, self._linger_deadline)
        self._linger_timer = self.loop.call_at(when, self._close_now)

    def _cancel_linger_timer(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
