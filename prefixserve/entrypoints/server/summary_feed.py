"""The cache summary the operator routes serve (serving_cache.py), built at most once per
interval however many callers ask.

The engine's step thread builds a summary, so the interval grows with the build's own time as
the engine measures it: the thread spends at most 1/BUSY_SHARE_DIVISOR of its time on summaries.
One feed per app, kept in its `ServerState` (state.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefixserve.engine.client import EngineClient

SUMMARY_INTERVAL_S = 1.0
# A summary built in t seconds is rebuilt at most every BUSY_SHARE_DIVISOR * t seconds.
BUSY_SHARE_DIVISOR = 20


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
