"""One interface for every tier below the RAM pool (`KVTier`), in the shape of vLLM's secondary
tiers: a lookup (`probe`) that answers how many leading blocks the tier holds in one call (one
round trip for a server), reads of a run of blocks in one call, each checked against its tokens
(`read_run`), and stores handed to the tier's own bounded writer (never blocking the caller).
Each tier owns its eviction (the disk's LRU and retention sweep, the server's
`maxmemory-policy` and TTLs) and says why a read missed.

`DiskTier` puts the local disk (`DiskKVStore` and its `BackgroundWriter`) on it; the shared tier
(`remote/redis_tier.py` `RedisTier`) implements it itself. The connector (`connector.py`)
cascades its tiers nearest first through this interface alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from prefixserve.core.kv_cache.tier_hit import DISK, REMOTE
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.disk_store import DiskKVStore
from prefixserve.kv_store.writer import BackgroundWriter

__all__ = ["DISK", "GROUP", "REMOTE", "BlockRead", "DiskTier", "KVTier"]

GROUP = 0  # the one full-attention KV-cache group the tiers serve

# One block of a read: its hash, its token ids and the hash of the block before it.
BlockRead = tuple[bytes, Sequence[int], bytes]

logger = logging.getLogger(__name__)

# The most `DiskTier.retain` waits for the writer's queued writes, in seconds.
RETAIN_FLUSH_S = 5.0


@runtime_checkable
class KVTier(Protocol):
    """A tier below the RAM pool, as the connector uses it."""

    name: str

    def probe(self, block_hashes: Sequence[bytes], group: int = 0) -> tuple[int, str | None]:
        """How many leading `block_hashes` the tier holds in `group`, and the fault that ended
        the run early (None: a plain miss, or every block held)."""
        ...

    def read_run(self, blocks: Sequence[BlockRead], group: int) -> tuple[list[bytes], str | None]:
        """The payloads of the leading `blocks` (block hash, token ids, parent hash) the tier
        holds, each checked against its identity, tokens and parent, in one call (one round trip
        for a server); the run stops at the first block that misses, with why (None: every
        block was read).
        Safe to call from a thread other than the step's (the connector's background loads)."""
        ...

    def holds(self, block_hash: bytes, group: int) -> bool:
        """Whether a save of this block may be skipped: the tier holds it already (a tier that
        deduplicates its own writes may always answer False)."""
        ...

    def submit_store(self, write: BlockWrite) -> bool:
        """Queue `write` for the tier's writer, the block kept until its `expires_at`; False
        when the writer's bounded queue is full (the write is dropped and counted)."""
        ...

    def retain(self, blocks: Sequence[BlockRead], group: int, expires_at: float | None) -> int:
        """Keep the held ones of `blocks` until `expires_at` (wall-clock seconds; None: until
        told otherwise; a pinned prefix); how many it held."""
        ...

    def metrics(self) -> dict[str, int | float]:
        """The tier's own counters, as the engine's metrics name them."""
        ...

    def clear(self) -> int:
        """Forget this host's blocks (a prefix-cache reset): how many went (a tier that other
        hosts share keeps them: 0)."""
        ...

    def close(self, timeout: float | None = 30.0) -> bool:
        """Write what is queued (up to `timeout` seconds), then stop; False when it did not
        finish in time."""
        ...


class DiskTier:
    """The local disk on the `KVTier` interface: lookups are stats, reads are checked files,
    stores go to the bounded `BackgroundWriter`."""

    name = DISK

    def __init__(self, store: DiskKVStore, writer: BackgroundWriter) -> None:
        self.store = store
        self.writer = writer

    def probe(self, block_hashes: Sequence[bytes], group: int = 0) -> tuple[int, str | None]:
        return self.store.count_prefix(block_hashes, (group,)), None

    def read_run(self, blocks: Sequence[BlockRead], group: int) -> tuple[list[bytes], str | None]:
        payloads: list[bytes] = []
        for block_hash, token_ids, parent in blocks:
            try:
                payload = self.store.get((block_hash, group), token_ids, parent)
            except OSError as exc:  # an I/O error is a miss, never the step's failure
                logger.warning("kv-store: reading a block failed: %s", exc)
                payload = None
            if payload is None:
                return payloads, "absent"
            payloads.append(payload)
        return payloads, None

    def holds(self, block_hash: bytes, group: int) -> bool:
        return self.store.contains((block_hash, group))

    def submit_store(self, write: BlockWrite) -> bool:
        return self.writer.submit(write)

    def retain(self, blocks: Sequence[BlockRead], group: int, expires_at: float | None) -> int:
        """Each held block's record written again with the new expiry (it is checksummed), on
        this thread, after the writer's queued writes (up to `RETAIN_FLUSH_S` seconds, so that
        none of them lands after it with the old expiry): an operator's pin, not a step's work.
        An I/O error leaves a block as it was."""
        self.writer.flush(RETAIN_FLUSH_S)
        held = 0
        for block_hash, token_ids, parent in blocks:
            key = (block_hash, group)
            try:
                payload = self.store.get(key, token_ids, parent)
                if payload is not None:
                    write = BlockWrite.at(key, token_ids, payload, expires_at, parent)
                    held += self.store.put(write) > 0
            except OSError as exc:
                logger.warning("kv-store: retaining a block failed: %s", exc)
        return held

    def metrics(self) -> dict[str, int | float]:
        store, writer = self.store.stats(), self.writer.stats()
        return {
            "kv_store_dropped_writes": writer.dropped,
            "kv_store_write_errors": writer.errors,
            "kv_store_bad_files_dropped": (
                store.corrupt_dropped + store.foreign_dropped + store.unauthenticated_dropped
            ),
            "kv_store_bytes_read": store.bytes_read,
            "kv_store_bytes_written": store.bytes_written,
            "kv_store_bytes": self.store.total_bytes,
        }

    def clear(self) -> int:
        """Drop the queued writes, wait for the one in progress, then delete every block of
        this namespace from the store; how many files went."""
        self.writer.discard()
        return self.store.clear()

    def close(self, timeout: float | None = 30.0) -> bool:
        return self.writer.close(timeout)
