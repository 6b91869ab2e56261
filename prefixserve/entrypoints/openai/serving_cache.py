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
engine's step thread, so however many pages are open it is built at most once per interval
(`SummaryFeed`), and at most MAX_EVENT_STREAMS streams are served at once (429 past it).
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

from prefixserve.engine.client import EngineClient
from prefixserve.entrypoints.openai.errors import OpenAIError
from prefixserve.entrypoints.openai.serving import ServerState

STATIC_DIR = Path(__file__).parent / "static" / "inspector"
# The files the page is made of, fixed at start-up: a request names one of these or gets a 404.
STATIC_FILES = {
    "inspector.js": "text/javascript",
    "inspector.css": "text/css",
}
SUMMARY_INTERVAL_S = 1.0
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
    """The latest summary of each kind (with or without text), rebuilt when older than
    `interval_s` and only by one caller at a time."""

    def __init__(self, engine: EngineClient, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._latest: dict[bool, tuple[float, dict[str, Any]]] = {}
        self._lock = asyncio.Lock()
        self.num_streams = 0

    async def get(self, include_text: bool) -> dict[str, Any]:
        async with self._lock:
            cached = self._latest.get(include_text)
            if cached is not None and time.monotonic() - cached[0] < self.interval_s:
                return cached[1]
            summary = await self.engine.cache_summary(include_text)
            self._latest[include_text] = (time.monotonic(), summary)
            return summary


def register_cache_routes(router: APIRouter, state: ServerState) -> None:
    """Add /v1/cache/summary and the /inspector routes to the app's router."""
    feed = SummaryFeed(state.engine)

    @router.get("/v1/cache/summary")
    async def cache_summary(text: bool = False) -> dict[str, Any]:
        return await state.engine.cache_summary(text)

    @router.get("/inspector", include_in_schema=False)
    async def inspector_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @router.get("/inspector/static/{name}", include_in_schema=False)
    async def inspector_static(name: str) -> FileResponse:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            raise OpenAIError(f"no inspector file {name!r}", status_code=404, type="not_found")
        return FileResponse(STATIC_DIR / name, media_type=media_type, headers=PAGE_HEADERS)

    @router.get("/inspector/events", include_in_schema=False)
    async def inspector_events(raw: Request, text: bool = False) -> StreamingResponse:
        if feed.num_streams >= MAX_EVENT_STREAMS:
            raise OpenAIError(
                f"at most {MAX_EVENT_STREAMS} inspector streams at once",
                status_code=429,
                type="rate_limit_error",
                code="too_many_streams",
            )
        return StreamingResponse(
            _events(feed, raw, text),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


async def _events(feed: SummaryFeed, raw: Request, include_text: bool) -> AsyncIterator[str]:
    """A `summary` event now and then every interval, until the client leaves."""
    feed.num_streams += 1
    try:
        yield f"retry: {int(feed.interval_s * 3000)}\n\n"
        while not await raw.is_disconnected():
            summary = await feed.get(include_text)
            yield f"event: summary\ndata: {json.dumps(summary)}\n\n"
            await asyncio.sleep(feed.interval_s)
    finally:
        feed.num_streams -= 1
