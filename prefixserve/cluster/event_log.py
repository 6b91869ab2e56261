"""A replica's side of the event stream: numbered batches, a replay ring, a snapshot mirror.

`EventLog.append(events)` turns the engine's drained KV events into the next `EventBatch`
(seq 0, 1, 2, ... within this process's epoch) and keeps the last `ring_batches` of them, so a
router that missed some asks `replay(from_seq)` instead of a snapshot. It also keeps a mirror of
the blocks the events say are cached (hash -> parent, token ids, extra keys, copies): when the
ring has moved past what the router needs, `snapshot()` describes the whole cache, stamped with
the seq it is current as of. The mirror is bounded by the pool: one entry per cached hash.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from prefixserve.cluster.messages import CachedBlock, EventBatch, Snapshot
from prefixserve.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

DEFAULT_RING_BATCHES = 1024


class EventLog:
    """Numbers one replica's event batches; replays recent ones; snapshots its cached blocks."""

    def __init__(self, replica_id: int, epoch: int, ring_batches: int = DEFAULT_RING_BATCHES):
        if ring_batches < 1:
            raise ValueError(f"ring_batches must be at least 1, got {ring_batches}")
        self.replica_id = replica_id
        self.epoch = epoch
        self.next_seq = 0
        self._ring: collections.deque[EventBatch] = collections.deque(maxlen=ring_batches)
        # hash -> [parent hash, token ids, extra keys, copies, LoRA name], in the order first
        # stored.
        self._blocks: dict[bytes, list] = {}

    def append(self, events: Iterable[KVCacheEvent]) -> EventBatch | None:
        """The next batch made of `events` (None when there are none), mirrored and kept."""
        events = tuple(events)
        if not events:
            return None
        for event in events:
            self._mirror(event)
        batch = EventBatch(self.replica_id, self.epoch, self.next_seq, events)
        self.next_seq += 1
        self._ring.append(batch)
        return batch

    def replay(self, from_seq: int) -> list[EventBatch] | None:
        """Batches `from_seq`, `from_seq + 1`, ... up to the newest; None when the ring no longer
        holds `from_seq` (ask for a snapshot), [] when nothing came after it."""
        if from_seq >= self.next_seq:
            return []
        if not self._ring or from_seq < self._ring[0].seq:
            return None
        first = self._ring[0].seq
        return list(self._ring)[from_seq - first :]

    def snapshot(self) -> Snapshot:
        """Every cached block as of now (before batch `next_seq`), parents before children
        wherever the parent is still cached."""
        blocks = tuple(
            CachedBlock(block_hash, parent, tokens, extra, copies, lora)
            for block_hash, (parent, tokens, extra, copies, lora) in self._blocks.items()
        )
        return Snapshot(self.replica_id, self.epoch, self.next_seq, blocks)

    @property
    def num_cached_hashes(self) -> int:
        return len(self._blocks)

    def _mirror(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            size = event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                entry = self._blocks.get(block_hash)
                if entry is not None:
                    entry[3] += 1
                    continue
                parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                self._blocks[block_hash] = [parent, tokens, event.extra_keys[i], 1, event.lora_name]
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                entry = self._blocks.get(block_hash)
                if entry is None:
                    continue
                entry[3] -= 1
                if entry[3] <= 0:
                    del self._blocks[block_hash]
        elif isinstance(event, AllBlocksCleared):
            self._blocks.clear()
