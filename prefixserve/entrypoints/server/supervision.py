"""What keeps `prefixserve serve` from outliving its engine: a dead step loop stops the server."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("prefixserve")


class EngineDeathWatch:
    """Stops the HTTP server when the engine's step loop dies unasked, so `prefixserve serve`
    exits non-zero (1) for a supervisor to restart it, instead of answering 503 for good.

    The async engine has already failed every in-flight request and queued command with
    EngineDeadError (503) when `on_dead` runs; a death from `shutdown()` is no failure."""

    def __init__(self, engine: Any, server: Any) -> None:
        self.engine = engine
        self.server = server
        self.error: BaseException | None = None

    def on_dead(self, exc: BaseException) -> None:
        if self.engine.shutdown_requested:
            return
        logger.error("the engine died (%r); stopping the server to exit with status 1", exc)
        self.server.should_exit = True
        self.error = exc  # last: a watcher that sees the error sees the server stopping
