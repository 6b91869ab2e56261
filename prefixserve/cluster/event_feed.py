"""The router's side of each replica's event stream: apply batches, heal gaps, follow restarts.

One task per replica (`EventFeed.run`) subscribes to the replica's `events(from_seq)` stream and
applies what comes to the router's index:
- a batch: applied; if batches before it are missing (the index says from which), the feed asks
  the replica to `replay` them from its ring, or for a `snapshot` once the ring has moved on;
- a Snapshot (the stream itself found it had fallen behind the ring): replaces the replica's view;
- a Heartbeat: the replica's next seq, so a lost last batch is noticed within a second.
When the stream breaks (the replica died), the replica is taken out of routing and the feed
waits for Ray to restart it, then registers it again (a new epoch: empty, or warm from the
store) and subscribes from seq 0.

`drop_fraction` drops that share of pushed batches on arrival (the benchmark's "lose 5% of
event batches" run); replays and snapshots are never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from prefixserve.cluster.protocol import EventBatch, Heartbeat, RegistrationError, Snapshot
from prefixserve.cluster.router import Router

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
    ) -> None:
        self.replica_id = replica_id
        self.handle = handle
        self.router = router
        self.drop_fraction = drop_fraction
        self.rng = rng or random.Random(replica_id)
        self.stats = FeedStats()
        self.up = True

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
                self.stats.snapshots += 1
                index.apply_snapshot(item)
            elif isinstance(item, Heartbeat):
                if self._current(item.epoch) and item.next_seq > index.next_seq(self.replica_id):
                    await self._heal(index.next_seq(self.replica_id))
            elif isinstance(item, EventBatch):
                self.stats.pushed += 1
                if self.drop_fraction and self.rng.random() < self.drop_fraction:
                    self.stats.dropped += 1
                    continue
                gap = index.apply(item)
                if gap is not None:
                    await self._heal(gap)

    async def _heal(self, from_seq: int) -> None:
        """Fetch what the index misses from `from_seq` on: a replay, else a snapshot."""
        batches = await self.handle.replay.remote(from_seq)
        if batches is None:
            self.stats.snapshots += 1
            self.router.index.apply_snapshot(await self.handle.snapshot.remote())
            return
        self.stats.replays += 1
        for batch in batches:
            self.router.index.apply(batch)

    def _current(self, epoch: int) -> bool:
        index = self.router.index
        return self.replica_id in index.replica_ids and index.epoch(self.replica_id) == epoch

    def _down(self) -> None:
        if self.up:
            self.up = False
            self.router.remove(self.replica_id)

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
