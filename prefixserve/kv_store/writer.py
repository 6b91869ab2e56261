"""`BackgroundWriter`: saves blocks to the store on its own thread, never slowing the caller.

The step loop hands a block's bytes to `submit`, which only appends to a queue bounded in items
and in bytes; when the queue is full the write is dropped and counted, never waited for (a block
not saved is only a future miss). One daemon thread drains the queue through `store.put`; a
failed write (disk full, permissions, a bad argument) is counted and logged once per kind of
error, never raised into anyone. When idle, the same thread sweeps expired files every
`sweep_interval_s`, so blocks with a retention are deleted from disk when they expire.

`flush` waits until everything queued is written (a graceful shutdown loses nothing that was
submitted); `close` flushes, drops what a timeout left and stops the thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.disk_store import BlockKey, DiskKVStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WriterStats:
    """Counters since the writer started; `pending_*`: what is queued or being written now (what
    the bounds limit)."""

    queued: int = 0  # accepted by submit
    written: int = 0
    skipped: int = 0  # already in the store or queued; or not stored (expired, too big)
    dropped: int = 0  # refused by submit: queue full, or closed
    errors: int = 0  # puts (and idle sweeps) that raised
    bytes_written: int = 0
    pending_items: int = 0
    pending_bytes: int = 0


@dataclass(slots=True)
class _Write:
    write: BlockWrite
    nbytes: int


class BackgroundWriter:
    """A bounded write queue in front of a `DiskKVStore`, drained by one daemon thread."""

    def __init__(
        self,
        store: DiskKVStore,
        *,
        max_queue_bytes: int,
        max_queue_items: int,
        skip_present: bool = True,
        sweep_interval_s: float | None = 300.0,
        name: str = "prefixserve-kv-writer",
    ) -> None:
        """`skip_present`: a key whose live file exists is not written again (its expiry is not
        extended). `sweep_interval_s`: how often the idle thread deletes expired files (None:
        never). Raises ValueError for a bound that is not a positive int."""
        for label, bound in (
            ("max_queue_bytes", max_queue_bytes),
            ("max_queue_items", max_queue_items),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound <= 0:
                raise ValueError(f"{label} must be a positive int, got {bound!r}")
        if sweep_interval_s is not None and not sweep_interval_s > 0:
            raise ValueError(f"sweep_interval_s must be positive or None, got {sweep_interval_s!r}")
        self.store = store
        self.max_queue_bytes = max_queue_bytes
        self.max_queue_items = max_queue_items
        self._skip_present = skip_present
        self._sweep_interval_s = sweep_interval_s
        self._cond = threading.Condition()
        self._queue: deque[_Write] = deque()
        self._keys: set[BlockKey] = set()  # queued or being written
        self._busy = False
        self._closed = False
        self._stats = WriterStats()
        self._logged: set[tuple[type, int | None]] = set()
        self._next_sweep = time.monotonic() + (sweep_interval_s or 0.0)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, write: BlockWrite) -> bool:
        """Queue a `store.put` of `write`; never blocks. False when the write was dropped (the
        writes queued or in progress would exceed the bound in items or bytes, or the writer is
        closed). The writer keeps references to its `token_ids` and `payload` until it is
        written: the caller must not change them (pass a copy of memory the runner will
        reuse)."""
        key, nbytes = write.key, write.nbytes
        with self._cond:
            if self._closed:
                self._stats.dropped += 1
                return False
            if key in self._keys:
                self._stats.skipped += 1
                return True
            stats = self._stats
            if (
                stats.pending_items >= self.max_queue_items
                or stats.pending_bytes + nbytes > self.max_queue_bytes
            ):
                stats.dropped += 1
                return False
            self._queue.append(_Write(write, nbytes))
            self._keys.add(key)
            stats.queued += 1
            stats.pending_items += 1
            stats.pending_bytes += nbytes
            self._cond.notify()
        return True

    def stats(self) -> WriterStats:
        """A snapshot of the counters."""
        with self._cond:
            return replace(self._stats)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write is done (written, skipped or failed); False when
        `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to `timeout`), then stop: later submits are dropped, and writes still queued
        after the timeout are dropped and counted. True when nothing was dropped."""
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            while self._queue:
                self._forget(self._queue.popleft())
                self._stats.dropped += 1
            self._cond.notify_all()
        self._thread.join(timeout)
        return drained

    def discard(self) -> int:
        """Drop every queued write (counted as dropped) and wait for the one in progress, so that
        nothing submitted before the call reaches the store after it; returns how many."""
        with self._cond:
            dropped = len(self._queue)
            while self._queue:
                self._forget(self._queue.popleft())
            self._stats.dropped += dropped
            self._cond.wait_for(lambda: not self._busy)
        return dropped

    def _forget(self, job: _Write) -> None:
        self._keys.discard(job.write.key)
        self._stats.pending_items -= 1
        self._stats.pending_bytes -= job.nbytes

    def _run(self) -> None:
        _lower_thread_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    if self._sweep_due():
                        break
                    self._cond.wait(self._wait_s())
                if self._closed and not self._queue:
                    return
                job = self._queue.popleft() if self._queue else None
                self._busy = True
            try:
                if job is None:
                    self._sweep()
                else:
                    self._write(job)
            finally:
                with self._cond:
                    if job is not None:
                        self._forget(job)
                    self._busy = False
                    self._cond.notify_all()

    def _sweep_due(self) -> bool:
        return self._sweep_interval_s is not None and time.monotonic() >= self._next_sweep

    def _wait_s(self) -> float | None:
        if self._sweep_interval_s is None:
            return None
        return max(0.0, self._next_sweep - time.monotonic())

    def _sweep(self) -> None:
        self._next_sweep = time.monotonic() + (self._sweep_interval_s or 0.0)
        try:
            self.store.sweep_expired()
        except Exception as exc:  # a sweep that fails is tried again next time
            self._error(exc, "sweeping expired KV store files")

    def _write(self, job: _Write) -> None:
        try:
            write = job.write
            if self._skip_present and self.store.contains(write.key):
                with self._cond:
                    self._stats.skipped += 1
                return
            written = self.store.put(write)
        except Exception as exc:
            self._error(exc, "writing a block to the KV store")
            return
        with self._cond:
            if written:
                self._stats.written += 1
                self._stats.bytes_written += written
            else:
                self._stats.skipped += 1

    def _error(self, exc: Exception, doing: str) -> None:
        with self._cond:
            self._stats.errors += 1
            kind = (type(exc), getattr(exc, "errno", None))
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(
                "KV store writer: error %s (%s); further ones are only counted: %s",
                doing,
                type(exc).__name__,
                exc,
            )


def _lower_thread_priority() -> None:
    """Run this thread at the lowest CPU priority (Linux: nice applies per thread id), so on a
    machine with as many busy threads as cores the step loop is never the one that waits."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
