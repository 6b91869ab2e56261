"""The router's side of each replica's event stream: apply batches, heal gaps, follow restarts.

One task per replica (`EventFeed.run`) subscribes to the replica's `events(from_seq)` stream and
applies what comes to the router's index:
- a batch: applied; if batches before it are missing (the index says from which), the feed asks
  the replica to `replay` them from its ring, or for a `snapshot` once the ring has moved on;
- a Snapshot (the stream itself found it had fallen behind the ring): replaces the replica's view;
- a Heartbeat: the replica's next seq, so a lost last batch is noticed within a second.
Each subscription starts from the replica's `snapshot()`, then follows from the seq it is current
as of: a fresh replica's is empty; a running one's (adopted by a restarted router, ray_cluster.py)
rebuilds the index from what the replica holds. When the stream breaks (the replica died), the
replica is taken out of routing and the feed waits for Ray to restart it, then registers it
again (a new epoch: empty, or warm from the store) and starts over from its snapshot.

`sink`, when given, receives what the feed applied as plain KV-cache events (the server's
`/kv_events` with replicas): each applied batch's events, and for a snapshot an
`AllBlocksCleared` then one `BlockStored` per cached copy, so a consumer's view of the replica is
replaced as the index's was.

`drop_fraction` drops that share of pushed batches on arrival (the benchmark's "lose 5% of
event batches" run); replays and snapshots are never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixserve.cluster.messages import EventBatch, Heartbeat, RegistrationError, Snapshot
from prefixserve.cluster.router import Router
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockStored, KVCacheEvent

# Receives (replica id, events) for what the feed applied.
EventSink = Callable[[int, Sequence[KVCacheEvent]], None]

logger = logging.getLogger(__name__)

RESTART_POLL_S = 0.5


@dataclass(slots=True)
class FeedStats:
    pushed: int = 0
    dropped: int = 0  # by drop_fraction
    replays: int = 0
    snapshots: int = 0
    restarts: int = 0


class EventFeed:
    """Keeps the router's view of one replica current for as long as the cluster runs."""

    def __init__(
        self,
        replica_id: int,
        handle: Any,
        router: Router,
        *,
        drop_fraction: float = 0.0,
        rng: random.Random | None = None,
        sink: EventSink | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.handle = handle
        self.router = router
        self.drop_fraction = drop_fraction
        self.rng = rng or random.Random(replica_id)
        self.sink = sink
        self.stats = FeedStats()
        self.up = True
        # Set once the first snapshot is applied (or the replica is found down): the client
        # routes nothing before, so a restarted router's first requests see the warm caches.
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor died, or its stream broke
                logger.warning("replica %d is down (%s); waiting for it", self.replica_id, exc)
            self._down()
            try:
                await self._rejoin()
            except RegistrationError:
                logger.exception("replica %d cannot rejoin; it is left out", self.replica_id)
                return

    async def _follow(self) -> None:
        index = self.router.index
        self._apply_snapshot(await self.handle.snapshot.remote())
        self.synced.set()
        from_seq = index.next_seq(self.replica_id) if self.replica_id in index.replica_ids else 0
        stream = self.handle.events.options(num_returns="streaming").remote(from_seq)
        try:
            await self._apply_stream(stream)
        finally:
            # The replica's generator never ends by itself: stop it with this subscription (a
            # new event loop, in the offline API, subscribes again).
            with contextlib.suppress(Exception):
                ray_cancel(stream)

    async def _apply_stream(self, stream: Any) -> None:
        index = self.router.index
        async for ref in stream:
            item = await ref
            if isinstance(item, Snapshot):
                self._apply_snapshot(item)
            elif isinstance(item, Heartbeat):
                if self._current(item.epoch) and item.next_seq > index.next_seq(self.replica_id):
                    await self._heal(index.next_seq(self.replica_id))
            elif isinstance(item, EventBatch):
                self.stats.pushed += 1
                if self.drop_fraction and self.rng.random() < self.drop_fraction:
                    self.stats.dropped += 1
                    continue
                gap = self._apply(item)
                if gap is not None:
                    await self._heal(gap)

    async def _heal(self, from_seq: int) -> None:
        """Fetch what the index misses from `from_seq` on: a replay, else a snapshot."""
        batches = await self.handle.replay.remote(from_seq)
        if batches is None:
            self._apply_snapshot(await self.handle.snapshot.remote())
            return
        self.stats.replays += 1
        for batch in batches:
            self._apply(batch)

    def _apply(self, batch: EventBatch) -> int | None:
        index = self.router.index
        before = self._position()
        gap = index.apply(batch)
        if self.sink is not None and self._position() != before:
            self.sink(self.replica_id, batch.events)
        return gap

    def _apply_snapshot(self, snapshot: Snapshot) -> None:
        before = self._position()
        self.stats.snapshots += 1
        self.router.index.apply_snapshot(snapshot)
        if self.sink is None or self._position() == before:
            return  # ignored: older than what the index had
        size = self.router.index.block_size
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for block in snapshot.blocks:
            stored = BlockStored(
                [block.block_hash],
                block.parent_hash,
                list(block.token_ids),
                size,
                block.lora_name,
                [block.extra_keys],
                0,
            )
            events.extend([stored] * block.copies)
        self.sink(self.replica_id, events)

    def _position(self) -> tuple[int, int] | None:
        """(epoch, next seq) of the index's view of this replica: it moves when something is
        applied."""
        index = self.router.index
        if self.replica_id not in index.replica_ids:
            return None
        return index.epoch(self.replica_id), index.next_seq(self.replica_id)

    def _current(self, epoch: int) -> bool:
        index = self.router.index
        return self.replica_id in index.replica_ids and index.epoch(self.replica_id) == epoch

    def _down(self) -> None:
        self.synced.set()  # nothing to wait for
        if self.up:
            self.up = False
            self.router.remove(self.replica_id)
            if self.sink is not None:
                self.sink(self.replica_id, [AllBlocksCleared()])  # its pool died with it

    async def _rejoin(self) -> None:
        """Wait until Ray has the replica back, then register its new epoch."""
        while True:
            try:
                info = await _with_timeout(self.handle.info.remote(), 30.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(RESTART_POLL_S)
                continue
            self.router.register(info)
            self.stats.restarts += 1
            self.up = True
            logger.info("replica %d is back (epoch %d)", self.replica_id, info.epoch)
            return


def ray_cancel(ref: Any) -> None:
    import ray

    ray.cancel(ref)


async def _with_timeout(awaitable: Awaitable[Any], seconds: float) -> Any:
    return await asyncio.wait_for(asyncio.ensure_future(awaitable), seconds)
