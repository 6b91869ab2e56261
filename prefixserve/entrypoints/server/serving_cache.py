"""The cache, for operators: its summary, and the live inspector page over it.

    GET /v1/cache/summary[?text=true]   -> the summary (docs/cache_reports.md); prefix text only
                                           with text=true
    GET /inspector                      -> the inspector page (static files of static/inspector/)
    GET /inspector/static/<file>        -> its script and style sheet
    GET /inspector/events[?text=true]   -> server-sent events: a `summary` event every
                                           SUMMARY_INTERVAL_S seconds

Operator-only, like every route that is not a tenant's (guard.py); the /inspector routes also
take the key as HTTP Basic (a browser's login prompt: any user name, the key as the password).
The summary names tenants and request ids, so no tenant key reads it. The summary is built on the
engine's step thread, so however many pages and callers ask, each kind (with or without text)
is built at most once per interval, and the interval grows with the build's own time, as the
engine measures it (`SummaryFeed`); at most MAX_EVENT_STREAMS streams are served at once (429
with Retry-After past it). Without API
keys every route is open to the one trusted user, but prefix text is refused (it would cross
the clients' salts).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask

from prefixserve.engine.client import EngineClient
from prefixserve.entrypoints.server.errors import OpenAIError, capacity_refusal
from prefixserve.entrypoints.server.guard import KEY_LOGIN_KEY
from prefixserve.entrypoints.server.state import ServerState

STATIC_DIR = Path(__file__).parent / "static" / "inspector"
# The files the page is made of, fixed at start-up: a request names one of these or gets a 404.
STATIC_FILES = {
    "inspector.js": "text/javascript",
    "inspector.css": "text/css",
}
SUMMARY_INTERVAL_S = 1.0
# A summary built in t seconds is rebuilt at most every BUSY_SHARE_DIVISOR * t seconds.
BUSY_SHARE_DIVISOR = 20
MAX_EVENT_STREAMS = 8
# No external script, style, image or connection: everything the page loads comes from here.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class SummaryFeed:
    """The latest summary of each kind (with or without text), rebuilt when older than the
    interval and by one caller at a time. The interval is `interval_s`, or more when a build
    took long: the engine's step thread builds it, and spends at most 1/BUSY_SHARE_DIVISOR of
    its time on it however many clients ask."""

    def __init__(self, engine: EngineClient, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.build_s = 0.0  # the last build's seconds
        self._latest: dict[bool, tuple[float, dict[str, Any]]] = {}
        self._lock = asyncio.Lock()
        self.num_streams = 0

    @property
    def current_interval_s(self) -> float:
        return max(self.interval_s, BUSY_SHARE_DIVISOR * self.build_s)

    async def get(self, include_text: bool) -> dict[str, Any]:
        async with self._lock:
            cached = self._latest.get(include_text)
            now = time.monotonic()
            if cached is not None and now - cached[0] < self.current_interval_s:
                return cached[1]
            summary = await self.engine.cache_summary(include_text)
            # The build's own time, measured by the engine: not the wait for the step thread
            # (behind a long step), which would space rebuilds by 20x that step.
            self.build_s = float(summary["build_s"])
            self._latest[include_text] = (time.monotonic(), summary)
            return summary


def register_cache_routes(router: APIRouter, state: ServerState) -> None:
    """Add /v1/cache/summary and the /inspector routes to the app's router."""
    feed = SummaryFeed(state.engine)

    def check_text(text: bool) -> None:
        if text and state.api_keys is None:
            # Without keys anyone may call this: prompt text would cross every client's salt.
            raise OpenAIError(
                "prefix text is shown to operators only: start the server with API keys "
                "(--api-key-file, --admin-api-key-file)",
                status_code=403,
                type="invalid_request_error",
                code="text_needs_operator_key",
                param="text",
            )

    @router.get("/v1/cache/summary")
    async def cache_summary(text: bool = False) -> dict[str, Any]:
        check_text(text)
        return await feed.get(text)

    @router.get("/inspector", include_in_schema=False)
    async def inspector_page(raw: Request) -> FileResponse:
        headers = dict(PAGE_HEADERS)
        sessions = state.inspector_sessions
        if sessions is not None and getattr(raw.state, KEY_LOGIN_KEY, False):
            # Logged in with the key: a session for the page's own requests (its event stream),
            # which a browser may send without the credentials (inspector_sessions.py).
            secure = raw.url.scheme == "https"
            headers["Set-Cookie"] = sessions.cookie(sessions.issue(), secure)
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=headers)

    @router.get("/inspector/static/{name}", include_in_schema=False)
    async def inspector_static(name: str) -> FileResponse:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            raise OpenAIError(f"no inspector file {name!r}", status_code=404, type="not_found")
        return FileResponse(STATIC_DIR / name, media_type=media_type, headers=PAGE_HEADERS)

    @router.get("/inspector/events", include_in_schema=False)
    async def inspector_events(raw: Request, text: bool = False) -> StreamingResponse:
        check_text(text)
        if feed.num_streams >= MAX_EVENT_STREAMS:
            raise capacity_refusal(
                f"at most {MAX_EVENT_STREAMS} inspector streams at once", "too_many_streams"
            )
        feed.num_streams += 1  # counted now, so streams opened together cannot pass the bound
        stream = _Stream(feed)
        return StreamingResponse(
            stream.events(raw, text),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
            background=BackgroundTask(stream.release),
        )


class _Stream:
    """One event stream's place in the feed's count, given back once: when its events end, or
    after the response if they never started."""

    def __init__(self, feed: SummaryFeed) -> None:
        self.feed = feed
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.feed.num_streams -= 1

    async def events(self, raw: Request, include_text: bool) -> AsyncIterator[str]:
        """A `summary` event now and then every interval, until the client leaves."""
        feed = self.feed
        try:
            yield f"retry: {int(feed.interval_s * 3000)}\n\n"
            while not await raw.is_disconnected():
                summary = await feed.get(include_text)
                yield f"event: summary\ndata: {json.dumps(summary)}\n\n"
                await asyncio.sleep(feed.current_interval_s)
        finally:
            self.release()
