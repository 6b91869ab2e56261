"""The inspector's session tokens: valid until their ttl, bounded in number (the oldest dropped),
unknown or oversized tokens refused, and the cookie's attributes."""

from __future__ import annotations

from prefixserve.entrypoints.server.inspector_sessions import (
    COOKIE_NAME,
    MAX_TOKEN_CHARS,
    InspectorSessions,
    cookie_token,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_session_is_valid_until_its_ttl_runs_out():
    clock = Clock()
    sessions = InspectorSessions(ttl_s=60, clock=clock)
    token = sessions.issue()
    assert sessions.valid(token)
    clock.now += 59
    assert sessions.valid(token)
    clock.now += 2
    assert not sessions.valid(token)


def test_sessions_are_bounded_and_the_oldest_goes_first():
    sessions = InspectorSessions(max_sessions=3, clock=Clock())
    tokens = [sessions.issue() for _ in range(4)]
    assert len(sessions) == 3
    assert not sessions.valid(tokens[0])
    assert all(sessions.valid(t) for t in tokens[1:])


def test_unknown_empty_and_oversized_tokens_are_refused():
    sessions = InspectorSessions(clock=Clock())
    sessions.issue()
    for token in (None, "", "guess", "x" * (MAX_TOKEN_CHARS + 1)):
        assert not sessions.valid(token)


def test_the_cookie_is_http_only_same_site_strict_scoped_to_the_inspector():
    sessions = InspectorSessions(ttl_s=600, clock=Clock())
    cookie = sessions.cookie("tok", secure=False)
    assert cookie.startswith(f"{COOKIE_NAME}=tok;")
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/inspector", "Max-Age=600"):
        assert attribute in cookie
    assert "Secure" not in cookie and "Secure" in sessions.cookie("tok", secure=True)
    assert cookie_token(f"other=1; {COOKIE_NAME}=abc; x=y") == "abc"
    assert cookie_token("other=1") is None and cookie_token(None) is None
