"""A bounded memory of evicted block hashes, so a report can tell `evicted` from `never_seen`.

An LRU of at most `capacity` hashes (an ARC-style ghost list): evicting the same hash again moves
it to the young end, and the oldest is forgotten when it is full. Each entry keeps the eviction's
time and cause (the pool's policy, or "reset"). The memory bound is measured, not guessed:
`bytes_bound` is the capacity times the measured size of one entry (key, value, the dict's slot
and the order links), shown in the engine's start-up log.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable

from prefixserve.config import DEFAULT_GHOST_ENTRIES, MAX_GHOST_ENTRIES

__all__ = ["DEFAULT_GHOST_ENTRIES", "MAX_GHOST_ENTRIES", "EvictionGhosts"]

# An OrderedDict entry beyond its key and value: the dict's entry (hash, key, value), up to two
# index slots of 8 bytes (the table is at most two-thirds full), the ordered dict's node (links,
# key, hash) and its fast-node slots (as many as the index).
_DICT_SLOT_BYTES = 3 * 8 + 2 * 8 + 48 + 2 * 8


class EvictionGhosts:
    """Recently evicted block hashes -> (unix time of the eviction, cause)."""

    __slots__ = ("capacity", "_entries")

    def __init__(self, capacity: int = DEFAULT_GHOST_ENTRIES) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(
                f"the ghost table's capacity must be an integer >= 0, got {capacity!r}"
            )
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, block_hashes: Iterable[bytes], when: float, cause: str) -> None:
        """Remember these hashes as evicted at `when` by `cause`, forgetting the oldest past the
        capacity."""
        if not self.capacity:
            return
        entries = self._entries
        value = (when, cause)
        for block_hash in block_hashes:
            entries[block_hash] = value
            entries.move_to_end(block_hash)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def get(self, block_hash: bytes) -> tuple[float, str] | None:
        """(when, cause) of this hash's last remembered eviction, or None."""
        return self._entries.get(block_hash)

    def clear(self) -> None:
        self._entries.clear()

    def bytes_bound(self, hash_bytes: int = 32) -> int:
        """The most memory the table can hold: capacity x one entry's measured size."""
        key = bytes(hash_bytes)
        value = (0.0, "lru")
        entry = sys.getsizeof(key) + sys.getsizeof(value) + sys.getsizeof(0.0) + _DICT_SLOT_BYTES
        return self.capacity * entry
