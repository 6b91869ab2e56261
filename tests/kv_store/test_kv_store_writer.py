"""Rules of the background writer (prefixserve/kv_store/writer.py)."""

from __future__ import annotations

import errno
import logging
import threading
import time

import pytest

from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.writer import BackgroundWriter
from tests.helpers.kv_store import FakeClock, key, open_store, payload, record_files, tokens

WAIT_S = 30.0  # only ever a bound on waiting for an event, never a timing assertion


class BlockingStore:
    """A store whose put waits until released; records what it was asked to write."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.puts = []

    def contains(self, key):
        return False

    def put(self, write):
        self.entered.set()
        assert self.release.wait(WAIT_S)
        self.puts.append(write.key)
        return len(write.payload)

    def sweep_expired(self):
        return 0


class FailingStore(BlockingStore):
    def __init__(self, error):
        super().__init__()
        self.error = error
        self.release.set()

    def put(self, write):
        raise self.error


def test_writer_writes_everything_submitted_by_flush(tmp_path):
    store = open_store(tmp_path)
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=100)
    for i in range(20):
        assert writer.submit(BlockWrite.at(key(i), tokens(i), payload(i)))
    assert writer.flush(WAIT_S)
    for i in range(20):
        assert store.get(key(i), tokens(i)) == payload(i)
    stats = writer.stats()
    assert (stats.queued, stats.written, stats.dropped, stats.errors) == (20, 20, 0, 0)
    assert stats.bytes_written == store.stats().bytes_written
    assert (stats.pending_items, stats.pending_bytes) == (0, 0)
    assert writer.close(WAIT_S)


def test_submit_never_blocks_a_full_queue_drops_and_counts():
    store = BlockingStore()
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=3)
    assert writer.submit(BlockWrite.at(key(0), tokens(0), payload(0)))
    assert store.entered.wait(WAIT_S)  # the thread is stuck in put, still holding one item
    assert writer.submit(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert writer.submit(BlockWrite.at(key(2), tokens(2), payload(2)))
    assert not writer.submit(
        BlockWrite.at(key(3), tokens(3), payload(3))
    )  # returns at once, dropped
    assert writer.stats().dropped == 1
    store.release.set()
    assert writer.flush(WAIT_S)
    assert store.puts == [key(0), key(1), key(2)]
    writer.close(WAIT_S)


def test_submit_beyond_the_byte_bound_is_dropped():
    store = BlockingStore()
    writer = BackgroundWriter(store, max_queue_bytes=3000, max_queue_items=100)
    assert writer.submit(BlockWrite.at(key(0), tokens(0), payload(0, 10)))
    assert store.entered.wait(WAIT_S)
    assert writer.submit(BlockWrite.at(key(1), tokens(1), payload(1, 2000)))
    assert not writer.submit(BlockWrite.at(key(2), tokens(2), payload(2, 1001)))
    assert writer.submit(
        BlockWrite.at(key(3), tokens(3), payload(3, 990))
    )  # the one being written counts
    assert not writer.submit(BlockWrite.at(key(4), tokens(4), payload(4, 4000)))  # never fits
    assert writer.stats().pending_bytes == 3000
    store.release.set()
    assert writer.flush(WAIT_S)
    assert writer.stats().dropped == 2
    writer.close(WAIT_S)


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "No space left on device"), PermissionError(errno.EACCES, "denied")],
)
def test_write_errors_are_counted_and_logged_once_never_raised(error, caplog):
    writer = BackgroundWriter(FailingStore(error), max_queue_bytes=1 << 20, max_queue_items=100)
    with caplog.at_level(logging.WARNING, logger="prefixserve.kv_store.writer"):
        for i in range(5):
            assert writer.submit(BlockWrite.at(key(i), tokens(i), payload(i)))
        assert writer.flush(WAIT_S)
    stats = writer.stats()
    assert (stats.errors, stats.written) == (5, 0)
    warnings = [r for r in caplog.records if r.name == "prefixserve.kv_store.writer"]
    assert len(warnings) == 1 and type(error).__name__ in warnings[0].getMessage()
    assert writer.close(WAIT_S)


def test_a_real_disk_error_does_not_stop_the_writer(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=100)
    real_put = store.put
    failures = iter([True, False, False])

    def put_failing_once(*args, **kwargs):
        if next(failures):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(*args, **kwargs)

    monkeypatch.setattr(store, "put", put_failing_once)
    for i in range(3):
        writer.submit(BlockWrite.at(key(i), tokens(i), payload(i)))
    assert writer.flush(WAIT_S)
    assert [store.contains(key(i)) for i in range(3)] == [False, True, True]
    assert writer.stats().errors == 1
    writer.close(WAIT_S)


def test_blocks_already_in_the_store_or_in_the_queue_are_not_written_twice(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(0), tokens(0), payload(0)))
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=100)
    assert writer.submit(BlockWrite.at(key(0), tokens(0), payload(0)))
    assert writer.flush(WAIT_S)
    assert writer.stats().skipped == 1 and writer.stats().written == 0
    blocking = BlockingStore()
    queued = BackgroundWriter(blocking, max_queue_bytes=1 << 20, max_queue_items=100)
    queued.submit(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert blocking.entered.wait(WAIT_S)
    assert queued.submit(BlockWrite.at(key(2), tokens(2), payload(2)))
    assert queued.submit(BlockWrite.at(key(2), tokens(2), payload(2)))
    assert queued.submit(BlockWrite.at(key(1), tokens(1), payload(1)))  # being written
    blocking.release.set()
    assert queued.flush(WAIT_S)
    assert blocking.puts == [key(1), key(2)]
    assert queued.stats().skipped == 2
    writer.close(WAIT_S)
    queued.close(WAIT_S)


def test_close_flushes_then_drops_later_submits(tmp_path):
    store = open_store(tmp_path)
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=100)
    for i in range(5):
        writer.submit(BlockWrite.at(key(i), tokens(i), payload(i)))
    assert writer.close(WAIT_S)
    assert len(record_files(tmp_path)) == 5
    assert not writer.submit(BlockWrite.at(key(9), tokens(9), payload(9)))
    assert writer.stats().dropped == 1


def test_close_after_a_timeout_drops_what_is_still_queued():
    store = BlockingStore()
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=100)
    writer.submit(BlockWrite.at(key(0), tokens(0), payload(0)))
    assert store.entered.wait(WAIT_S)
    writer.submit(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert not writer.close(timeout=0.01)  # the put in flight cannot finish
    store.release.set()
    writer._thread.join(WAIT_S)
    assert store.puts == [key(0)]
    stats = writer.stats()
    assert stats.dropped == 1 and stats.pending_items == 0


def test_the_idle_writer_deletes_expired_blocks_from_disk(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    store.put(BlockWrite.at(key(0), tokens(0), payload(0), expires_at=clock.now + 60))
    clock.advance(61)
    writer = BackgroundWriter(
        store, max_queue_bytes=1 << 20, max_queue_items=10, sweep_interval_s=0.01
    )
    deadline = time.monotonic() + WAIT_S
    # The sweep unlinks during its scan and counts after it: wait for both.
    while (
        record_files(tmp_path) or store.stats().expired_deleted == 0
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert record_files(tmp_path) == []
    assert store.stats().expired_deleted == 1
    writer.close(WAIT_S)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue_bytes": 0, "max_queue_items": 1},
        {"max_queue_bytes": 1, "max_queue_items": -1},
        {"max_queue_bytes": 1, "max_queue_items": True},
        {"max_queue_bytes": 1, "max_queue_items": 1, "sweep_interval_s": 0},
    ],
)
def test_writer_bounds_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        BackgroundWriter(BlockingStore(), **kwargs)
