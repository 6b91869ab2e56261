"""Browser sessions of the inspector: how its live view works however the operator logged in.

A browser sends the credentials of a login (typed into its password prompt, kept by a password
manager, or given in the URL as `http://user:KEY@host/inspector`) with the page load, but not
always with the page's own requests: Chromium sends URL credentials with the page only, so the
page's EventSource would arrive without a key and stay "connecting". So a page load the request
guard authenticated with an operator key gets a session cookie, and the inspector's read-only
routes (GET /inspector, its files and its event stream) take that cookie as well.

The cookie is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends
it), `Path=/inspector` (the browser sends it nowhere else), `Secure` over HTTPS, and lives
`SESSION_TTL_S`. The server keeps only digests of the tokens it issued, with their expiry, at
most `MAX_SESSIONS` (the oldest dropped first). A cookie is never accepted on any other route:
the routes that change state take a key only.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

COOKIE_NAME = "prefixserve_inspector_session"
COOKIE_PATH = "/inspector"
SESSION_TTL_S = 3600
MAX_SESSIONS = 64
# A cookie value longer than a token is refused unread.
MAX_TOKEN_CHARS = 128


class InspectorSessions:
    """Issued session tokens (by digest) and their expiry; bounded."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def issue(self) -> str:
        """A new token, valid for `ttl_s`."""
        self._drop_expired()
        while len(self._expiry) >= self.max_sessions:
            self._expiry.popitem(last=False)
        token = secrets.token_urlsafe(32)
        self._expiry[_digest(token)] = self.clock() + self.ttl_s
        return token

    def valid(self, token: str | None) -> bool:
        """Whether `token` was issued here and has not expired."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return False
        expiry = self._expiry.get(_digest(token))
        return expiry is not None and self.clock() < expiry

    def cookie(self, token: str, secure: bool) -> str:
        """The Set-Cookie value that hands `token` to the browser."""
        attributes = [
            f"{COOKIE_NAME}={token}",
            f"Path={COOKIE_PATH}",
            f"Max-Age={int(self.ttl_s)}",
            "HttpOnly",
            "SameSite=Strict",
        ]
        if secure:
            attributes.append("Secure")
        return "; ".join(attributes)

    def _drop_expired(self) -> None:
        now = self.clock()
        for digest in [d for d, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[digest]


def cookie_token(cookie_header: str | None) -> str | None:
    """The session token of a `Cookie` header, or None."""
    if not cookie_header or len(cookie_header) > 8192:
        return None
    for part in cookie_header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name == COOKIE_NAME:
            return value.strip()
    return None


def _digest(token: str) -> bytes:
    # Looked up by digest: a dict probe on the digest leaks nothing about the token's bytes.
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()
