"""`DiskKVStore`: content-addressed files holding one block of one KV-cache group each.

    <root>/seed                                       the store's secret (seed.py)
    <root>/<namespace>/<2 hex>/<hash hex>-g<group>.kv  one record (record.py), 0600, dirs 0700

Key = (block hash, group). A file appears under its final name only by `os.replace` of a complete
temporary file, and every read checks the record's length, checksum and identity (namespace, hash,
group, token ids), so a reader gets exactly the bytes that were put for that key or a miss; a bad
file is a miss that removes it. Several processes may share the directory: they only ever create
(by rename) and delete whole files, and a file being read stays intact when it is replaced or
deleted meanwhile.

File times carry the two facts a stat must answer without reading the file:
- mtime = the record's expiry (0 = never), so `contains` and `sweep_expired` need no read;
- atime = last use (set on put and on every hit), the order of eviction (least recently used).
A file modified after it was written (its mtime is then the time of the change) therefore looks
expired: a stat-only check skips it and the next sweep deletes it, which is what a damaged file
deserves; `get` trusts only the checksummed header.

The capacity covers the whole root, every namespace, so blocks of a replaced model age out as the
new one fills the store. The store keeps a running byte total of what it writes and deletes; a
full scan (at open, every `rescan_interval_s` seconds of puts, in `sweep_expired` and before each
eviction) counts what other processes wrote. Past the capacity it deletes least recently used
files down to `low_watermark` of it; a file that vanished meanwhile is simply gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import prefixserve.kv_store.record as record
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.fs import (
    CREATE_EXCLUSIVE,
    OPEN_READ,
    PRIVATE_FILE_MODE,
    ensure_private_dir,
    make_private_subdir,
    temp_name,
    unlink_quietly,
    write_all,
)
from prefixserve.kv_store.lookup import BlockKey, StoreLookup, check_key
from prefixserve.kv_store.scan import ScanResult, namespace_records, scan_store
from prefixserve.kv_store.tier_key import TierKey


@dataclass(slots=True)
class DiskStoreStats:
    """Counters since the store was opened (this process's view)."""

    hits: int = 0
    misses: int = 0
    corrupt_dropped: int = 0  # damaged or truncated files removed
    foreign_dropped: int = 0  # valid records of something else (namespace, format, collision)
    unauthenticated_dropped: int = 0  # with a key: records whose MAC failed (forged or damaged)
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    expired_deleted: int = 0
    temp_files_removed: int = 0  # abandoned by killed writers
    cleared: int = 0  # deleted by `clear` (a prefix-cache reset)


class DiskKVStore(StoreLookup):
    """One store directory seen through one namespace: lookups, loads and saves of blocks.

    Thread-safe: the scheduler may call `contains`, a worker `get`, and a writer thread `put` at
    once. `put` raises OSError on I/O failure (disk full...); run it on a `BackgroundWriter`.
    """

    def __init__(
        self,
        root: str | Path,
        namespace: str,
        capacity_bytes: int,
        *,
        low_watermark: float = 0.9,
        rescan_interval_s: float = 60.0,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
        key: TierKey | None = None,
    ) -> None:
        """Open (creating if needed) the store at `root` for `namespace` (fingerprint.py's
        `store_namespace`); scans it once. `fsync` is off by default: a record damaged by a
        power loss fails its checksum and is a miss, so durability costs nothing in safety.
        `clock` gives unix time (a test may pass a fake one). `key`: records carry its MAC
        instead of a checksum (a directory other hosts write: `--kv-store-key-file`).

        Raises ValueError for bad arguments, UnsafeStoreError for a root others can access.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValueError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0.0 <= low_watermark <= 1.0:
            raise ValueError(f"low_watermark must be in [0, 1], got {low_watermark}")
        super().__init__(root, namespace, clock=clock)
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.rescan_interval_s = rescan_interval_s
        self._fsync = fsync
        self.tier_key = key
        self._namespace_raw = bytes.fromhex(namespace)
        self._lock = threading.Lock()  # stats and the byte total
        self._maintenance = threading.Lock()  # one scan / eviction at a time
        self._stats = DiskStoreStats()
        self._total_bytes = 0
        self._last_scan = 0.0
        ensure_private_dir(self.root)
        make_private_subdir(self._dir)
        self.rescan()

    # ---- stats

    def stats(self) -> DiskStoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    @property
    def total_bytes(self) -> int:
        """Bytes in the whole store as last counted (own writes since the last scan included)."""
        return self._total_bytes

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    # ---- worker side: moving bytes (the stat-only lookups are StoreLookup's)

    def put(self, write: BlockWrite) -> int:
        """Store the block `write` names: its payload (the block's K/V, C-contiguous) under its
        key, with its token ids and the hash of the block before it (its `parent`: a reader
        must name the same one), replacing any file of that key; it expires at unix time
        `write.expires_at` (None: never, only evicted). Returns the bytes written: 0 when
        nothing was stored (already expired, or larger than the capacity). Atomic: readers see
        the old file, the new one or none, never a part. Raises ValueError for a bad key or
        token id, OSError when the write fails."""
        key, expires_at, parent = write.key, write.expires_at, write.parent
        block_hash, group = check_key(key)
        tokens = record.pack_tokens(write.token_ids)
        body = memoryview(write.payload)
        if not body.c_contiguous:
            raise ValueError("payload must be a C-contiguous buffer")
        body = body.cast("B")
        now_ns = self._now_ns()
        expires_ns = 0 if expires_at is None else max(1, int(expires_at * 1e9))
        size = record.record_length(len(block_hash), len(tokens) // 4, body.nbytes, len(parent))
        if record.is_expired(expires_ns, now_ns) or size > self.capacity_bytes:
            return 0
        header = record.encode_header(
            self._namespace_raw, block_hash, group, tokens, body.nbytes, expires_ns, parent
        )
        digest = record.checksum(header, body, self.tier_key)
        final = self.path(key)
        shard, name = final.rsplit("/", 1)
        self._make_shard(shard)
        tmp = f"{shard}/{temp_name(name)}"
        try:
            fd = os.open(tmp, CREATE_EXCLUSIVE, PRIVATE_FILE_MODE)
            try:
                write_all(fd, [header, body, digest])
                if self._fsync:
                    os.fsync(fd)
                # After the last write: atime = last use, mtime = expiry.
                os.utime(fd, ns=(now_ns, expires_ns))
            finally:
                os.close(fd)
            try:
                replaced = os.stat(final, follow_symlinks=False).st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(tmp, final)
        except BaseException:
            unlink_quietly(tmp)
            raise
        with self._lock:
            self._total_bytes += size - replaced
            self._stats.bytes_written += size
        self._maintain()
        return size

    def get(self, key: BlockKey, token_ids: Sequence[int], parent: bytes = b"") -> bytes | None:
        """The payload stored for `key` with exactly these `token_ids` after `parent`, or None
        (a miss). A damaged, truncated, foreign or expired file is removed and counted; a hit
        refreshes the file's recency."""
        return self._read(key, token_ids, None, parent)

    def get_into(
        self,
        key: BlockKey,
        token_ids: Sequence[int],
        out: memoryview | bytearray,
        parent: bytes = b"",
    ) -> bool:
        """Like `get` (the same checks, `parent` included), reading the payload straight into
        `out` (a writable buffer of exactly the payload's size, e.g. a staging tensor's memory).
        False is a miss, and then `out`'s content is undefined: the caller must not use it."""
        view = memoryview(out)
        if view.readonly or not view.c_contiguous:
            raise ValueError("out must be a writable C-contiguous buffer")
        return self._read(key, token_ids, view.cast("B"), parent) is not None

    def _read(
        self,
        key: BlockKey,
        token_ids: Sequence[int],
        out: memoryview | None,
        parent: bytes = b"",
    ) -> bytes | None:
        block_hash, group = check_key(key)
        tokens = record.pack_tokens(token_ids)
        path = self.path(key)
        try:
            fd = os.open(path, OPEN_READ)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError:  # a symlink, a directory: not ours
            self._drop(path, None, record.FOREIGN)
            return None
        try:
            st = os.fstat(fd)
            try:
                payload = record.read_record(
                    fd,
                    st,
                    self._namespace_raw,
                    block_hash,
                    group,
                    tokens,
                    out,
                    self._now_ns(),
                    parent,
                    self.tier_key,
                )
            except record.RecordError as exc:
                self._drop(path, st, exc.kind)
                return None
            now_ns = self._now_ns()
            if payload is None:  # expired
                if self._unlink_same(path, st):
                    self._count(expired_deleted=1)
                self._count(misses=1)
                return None
            try:
                os.utime(fd, ns=(now_ns, st.st_mtime_ns))
            except OSError:
                pass  # recency is a hint
        finally:
            os.close(fd)
        self._count(hits=1, bytes_read=st.st_size)
        return payload

    def _drop(self, path: str, st: os.stat_result | None, kind: str) -> None:
        """Remove a bad file (unless another process already replaced it) and count it."""
        if st is None:
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                st = None
        if st is not None:
            self._unlink_same(path, st)
        self._count(misses=1, **{f"{kind}_dropped": 1})

    def _unlink_same(self, path: str, st: os.stat_result) -> bool:
        """Unlink `path` if it is still the file `st` describes; True when this call removed it."""
        try:
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not unlink_quietly(path):
                return False
        except FileNotFoundError:
            return False
        with self._lock:
            self._total_bytes -= st.st_size
        return True

    def _make_shard(self, shard: str) -> None:
        try:
            make_private_subdir(shard)
        except FileNotFoundError:  # the namespace (or the root) was removed under us
            ensure_private_dir(self.root)
            make_private_subdir(self._dir)
            make_private_subdir(shard)

    # ---- capacity, expiry and other processes' files

    def _maintain(self) -> None:
        if self._total_bytes > self.capacity_bytes:
            self.evict()
        elif time.monotonic() - self._last_scan > self.rescan_interval_s:
            self.rescan()

    def rescan(self) -> int:
        """Recount the whole store (other processes write to it too), deleting expired files and
        abandoned temporary files; returns the byte total."""
        with self._maintenance:
            return self._scan(collect=False).total_bytes

    def sweep_expired(self) -> int:
        """Delete every expired file of the store (all namespaces); returns how many."""
        with self._maintenance:
            return self._scan(collect=False).expired

    def evict(self, target_bytes: int | None = None) -> int:
        """Delete least recently used files until the store holds at most `target_bytes`
        (default: `low_watermark` of the capacity); returns how many this call deleted."""
        if target_bytes is None:
            target_bytes = int(self.capacity_bytes * self.low_watermark)
        with self._maintenance:
            scan = self._scan(collect=True)
            total, evicted = scan.total_bytes, 0
            scan.files.sort()
            for _, size, path in scan.files:
                if total <= target_bytes:
                    break
                evicted += unlink_quietly(path)  # vanished meanwhile: gone all the same
                total -= size
            with self._lock:
                self._total_bytes = total
                self._stats.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Delete every record of this store's namespace, whichever process wrote it (the
        directory is shared: every process serving this model, dtype and layout from it loses
        them); returns how many. Other namespaces and the seed stay."""
        with self._maintenance:
            removed = sum(unlink_quietly(path) for path in namespace_records(self._dir))
            self._scan(collect=False)
        self._count(cleared=removed)
        return removed

    def _scan(self, collect: bool) -> ScanResult:
        """Scan the root (`scan.scan_store`) and take its byte total. Call with `_maintenance`
        held."""
        scan = scan_store(str(self.root), self._now_ns(), collect)
        with self._lock:
            self._total_bytes = scan.total_bytes
            self._stats.expired_deleted += scan.expired
            self._stats.temp_files_removed += scan.temps_removed
        self._last_scan = time.monotonic()
        return scan
