"""`StoreLookup`: which blocks of one store namespace have a live file, by stat alone.

The read-only face of a store directory (layout in disk_store.py): no reads, no writes, no scan
at open, so it is cheap to open anywhere the directory is visible. `DiskKVStore` builds on it;
the cluster router opens one on the replicas' shared store to price store-resident blocks.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import prefixserve.kv_store.record as record

BlockKey = tuple[bytes, int]
"""(block hash, KV-cache group index)."""

_NAMESPACE = re.compile(r"^[0-9a-f]{32}$")


def check_key(key: BlockKey) -> tuple[bytes, int]:
    block_hash, group = key
    if not isinstance(block_hash, bytes) or not 1 <= len(block_hash) <= record.MAX_HASH_BYTES:
        raise ValueError(f"block hash must be 1-{record.MAX_HASH_BYTES} bytes, got {block_hash!r}")
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group <= record.MAX_GROUP:
        raise ValueError(f"group must be an int in [0, {record.MAX_GROUP}], got {group!r}")
    return block_hash, group


class StoreLookup:
    """Stat-only lookups in `<root>/<namespace>`; raises ValueError for a malformed namespace."""

    def __init__(
        self, root: str | Path, namespace: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise ValueError(f"namespace must be 32 lowercase hex digits, got {namespace!r}")
        self.root = Path(root)
        self.namespace = namespace
        self._clock = clock
        self._dir = str(self.root / namespace)

    def path(self, key: BlockKey) -> str:
        """The file that holds `key` (whether or not it exists)."""
        block_hash, group = check_key(key)
        hex_hash = block_hash.hex()
        return f"{self._dir}/{hex_hash[:2]}/{hex_hash}-g{group}.kv"

    def _now_ns(self) -> int:
        return int(self._clock() * 1e9)

    def contains(self, key: BlockKey) -> bool:
        """Whether a live (unexpired) file holds `key`: one stat, no read. A True may still be a
        miss in a read (a concurrent eviction, a damaged file)."""
        return self.state(key) == "live"

    def state(self, key: BlockKey) -> str | None:
        """ "live", "expired" (a file past its retention, not yet swept) or None (no file): one
        stat, no read."""
        try:
            st = os.stat(self.path(key), follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return "expired" if record.is_expired(st.st_mtime_ns, self._now_ns()) else "live"

    def count_prefix(self, block_hashes: Sequence[bytes], groups: Iterable[int]) -> int:
        """How many leading `block_hashes` have a live file in every one of `groups`."""
        groups = tuple(groups)
        for i, block_hash in enumerate(block_hashes):
            if not all(self.contains((block_hash, group)) for group in groups):
                return i
        return len(block_hashes)
