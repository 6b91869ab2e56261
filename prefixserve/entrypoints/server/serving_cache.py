"""The cache, for operators: its summary, and the live inspector page over it.

    GET /v1/cache/summary[?text=true]   -> the summary (docs/cache_reports.md); prefix text only
                                           with text=true
    GET /inspector                      -> the inspector page (static files of static/inspector/)
    GET /inspector/static/<file>        -> its script and style sheet
    GET /inspector/events[?text=true]   -> server-sent events: a `summary` event every
                                           SUMMARY_INTERVAL_S seconds (summary_feed.py)

Operator-only, like every route that is not a tenant's (guard.py); the /inspector routes also
take the key as HTTP Basic (a browser's login prompt: any user name, the key as the password).
The summary names tenants and request ids, so no tenant key reads it. The summary is built on the
engine's step thread, so however many pages and callers ask, each kind (with or without text)
is built at most once per interval, and the interval grows with the build's own time, as the
engine measures it (summary_feed.py); at most MAX_EVENT_STREAMS streams are served at once (429
with Retry-After past it). Without API
keys every route is open to the one trusted user, but prefix text is refused (it would cross
the clients' salts).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask

from prefixserve.entrypoints.server.errors import OpenAIError, capacity_refusal
from prefixserve.entrypoints.server.guard import KEY_LOGIN_KEY
from prefixserve.entrypoints.server.state import ServerState, server_state
from prefixserve.entrypoints.server.summary_feed import SummaryFeed

STATIC_DIR = Path(__file__).parent / "static" / "inspector"
# The files the page is made of, fixed at start-up: a request names one of these or gets a 404.
STATIC_FILES = {
    "inspector.js": "text/javascript",
    "inspector.css": "text/css",
}
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


router = APIRouter()


def _check_text(state: ServerState, text: bool) -> None:
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
async def cache_summary(raw: Request, text: bool = False) -> dict[str, Any]:
    state = server_state(raw)
    _check_text(state, text)
    return await state.summary_feed.get(text)


@router.get("/inspector", include_in_schema=False)
async def inspector_page(raw: Request) -> FileResponse:
    headers = dict(PAGE_HEADERS)
    sessions = server_state(raw).inspector_sessions
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
    state = server_state(raw)
    _check_text(state, text)
    feed = state.summary_feed
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
