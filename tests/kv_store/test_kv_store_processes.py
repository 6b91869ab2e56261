"""Several real processes on one store directory (prefixserve/kv_store/disk_store.py)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

from prefixserve.kv_store import record
from prefixserve.kv_store.block_write import BlockWrite
from tests.helpers.kv_store import (
    block_hash,
    key,
    open_store,
    payload,
    record_files,
    temp_files,
    tokens,
)

WAIT_S = 60.0  # a bound on waiting for the children, never a timing assertion
NUM_KEYS = 24


def _size(i: int) -> int:
    return 2000 + (i % 5) * 3000


def _share_the_store(root, seed, rounds, barrier, results):
    """Write and read the same keys as the other process, with two token-id variants per key (a
    stand-in for hash collisions) and a capacity small enough that eviction runs all along."""
    rng = random.Random(seed)
    store = open_store(root, capacity=120_000)
    wrong = hits = 0
    barrier.wait()
    for _ in range(rounds):
        i, variant, group = rng.randrange(NUM_KEYS), rng.randrange(2), rng.randrange(2)
        expected = payload(i, _size(i), variant, group)
        if rng.random() < 0.5:
            store.put(BlockWrite.at(key(i, group), tokens(i, variant), expected))
        elif rng.random() < 0.5:
            got = store.get(key(i, group), tokens(i, variant))
            wrong += got is not None and got != expected
            hits += got is not None
        else:
            out = bytearray(len(expected))
            if store.get_into(key(i, group), tokens(i, variant), out):
                wrong += bytes(out) != expected
                hits += 1
    results.put((wrong, hits))


def test_two_processes_sharing_a_store_never_read_wrong_bytes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_share_the_store, args=(tmp_path, seed, 1500, barrier, results))
        for seed in (1, 2)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=WAIT_S) for _ in processes]
    for process in processes:
        process.join(WAIT_S)
        assert process.exitcode == 0
    assert [wrong for wrong, _ in outcomes] == [0, 0]
    assert sum(hits for _, hits in outcomes) > 0
    assert temp_files(tmp_path) == []
    # Whatever is left is readable as exactly one of the two variants.
    store = open_store(tmp_path, capacity=120_000)
    names = {f"{block_hash(i).hex()}-g{g}.kv": (i, g) for i in range(NUM_KEYS) for g in (0, 1)}
    for path in record_files(tmp_path):
        i, group = names[path.name]
        data = path.read_bytes()
        (variant,) = [v for v in (0, 1) if record.pack_tokens(tokens(i, v)) in data]
        assert store.get(key(i, group), tokens(i, variant)) == payload(i, _size(i), variant, group)
    stats = store.stats()
    assert (stats.corrupt_dropped, stats.foreign_dropped, stats.misses) == (0, 0, 0)


def _write_large_blocks_forever(root, puts):
    store = open_store(root)
    i = 0
    while True:
        store.put(BlockWrite.at(key(i % 8), tokens(i % 8), payload(i % 8, 4 << 20)))
        i += 1
        puts.value = i


def _hang_halfway_through_a_write(root, mid_write):
    """Write key 0 whole, then start replacing it and stop halfway (to be killed there)."""
    from prefixserve.kv_store import disk_store

    store = open_store(root)
    store.put(BlockWrite.at(key(0), tokens(0), payload(0, 1 << 20)))

    def write_half(fd, buffers):
        header, body, _ = buffers
        os.write(fd, header)
        os.write(fd, memoryview(body)[: len(body) // 2])
        mid_write.set()
        time.sleep(WAIT_S)

    disk_store.write_all = write_half
    store.put(BlockWrite.at(key(0), tokens(0), payload(0, 1 << 20, variant=1)))
    store.put(BlockWrite.at(key(1), tokens(1), payload(1, 1 << 20)))


def _check_store_after_kills(root, sizes):
    store = open_store(root)  # must not raise
    assert temp_files(root) == []
    files = record_files(root)
    names = {f"{block_hash(i).hex()}-g0.kv": i for i in range(8)}
    for path in files:
        i = names[path.name]
        assert store.get(key(i), tokens(i)) == payload(i, sizes[i])
    stats = store.stats()
    assert (stats.corrupt_dropped, stats.foreign_dropped, stats.hits) == (0, 0, len(files))
    assert store.total_bytes == sum(p.stat().st_size for p in files)
    return store


def test_writer_killed_mid_write_by_sigkill_leaves_a_store_the_next_open_reads(tmp_path):
    ctx = multiprocessing.get_context("fork")
    mid_write = ctx.Event()
    child = ctx.Process(target=_hang_halfway_through_a_write, args=(tmp_path, mid_write))
    child.start()
    assert mid_write.wait(WAIT_S)
    os.kill(child.pid, signal.SIGKILL)
    child.join(WAIT_S)  # reaped: its pid is no longer alive
    assert child.exitcode == -signal.SIGKILL
    assert len(temp_files(tmp_path)) == 1  # the half-written replacement
    store = _check_store_after_kills(tmp_path, {0: 1 << 20})
    assert store.stats().temp_files_removed == 1
    assert len(record_files(tmp_path)) == 1  # key 0, the old version, intact


def test_writers_killed_by_sigkill_at_random_moments_leave_a_readable_store(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    for _ in range(6):
        puts = ctx.Value("i", 0)
        child = ctx.Process(target=_write_large_blocks_forever, args=(tmp_path, puts))
        child.start()
        deadline = time.monotonic() + WAIT_S
        while puts.value < 1 and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.03))
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT_S)
        assert child.exitcode == -signal.SIGKILL
    _check_store_after_kills(tmp_path, dict.fromkeys(range(8), 4 << 20))
