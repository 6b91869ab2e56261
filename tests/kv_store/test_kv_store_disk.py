"""Rules of the disk store (prefixserve/kv_store/disk_store.py, record.py, scan.py)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat

import pytest

from prefixserve.kv_store import record
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.fs import UnsafeStoreError
from tests.helpers.kv_store import (
    NAMESPACE,
    OTHER_NAMESPACE,
    FakeClock,
    key,
    open_store,
    payload,
    record_files,
    temp_files,
    tokens,
)


def test_round_trip_returns_exactly_the_bytes_put(tmp_path):
    store = open_store(tmp_path)
    written = store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert written == os.path.getsize(store.path(key(1)))
    assert store.contains(key(1))
    assert store.get(key(1), tokens(1)) == payload(1)
    out = bytearray(len(payload(1)))
    assert store.get_into(key(1), tokens(1), out)
    assert bytes(out) == payload(1)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_written) == (2, 0, written)
    assert stats.bytes_read == 2 * written


def test_a_new_store_object_on_the_same_directory_reads_what_an_earlier_one_wrote(tmp_path):
    open_store(tmp_path).put(BlockWrite.at(key(1), tokens(1), memoryview(payload(1))))
    again = open_store(tmp_path)
    assert again.total_bytes == os.path.getsize(again.path(key(1)))
    assert again.get(key(1), tokens(1)) == payload(1)


def test_each_group_of_a_block_is_its_own_file(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1, 0), tokens(1), payload(1, group=0)))
    assert not store.contains(key(1, 1))
    assert store.get(key(1, 1), tokens(1)) is None
    store.put(BlockWrite.at(key(1, 1), tokens(1), payload(1, group=1)))
    assert store.get(key(1, 0), tokens(1)) == payload(1, group=0)
    assert store.get(key(1, 1), tokens(1)) == payload(1, group=1)


def test_files_sit_under_namespace_shard_and_hash_named_paths(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(7, 2), tokens(7), payload(7)))
    hex_hash = key(7)[0].hex()
    assert store.path(key(7, 2)) == f"{tmp_path}/{NAMESPACE}/{hex_hash[:2]}/{hex_hash}-g2.kv"
    assert record_files(tmp_path) == [tmp_path / NAMESPACE / hex_hash[:2] / f"{hex_hash}-g2.kv"]


def test_permissions_files_0600_directories_0700(tmp_path):
    old_umask = os.umask(0)  # the store must not rely on the caller's umask
    try:
        root = tmp_path / "store"
        store = open_store(root)
        store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    finally:
        os.umask(old_umask)
    path = store.path(key(1))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for directory in (root, root / NAMESPACE, os.path.dirname(path)):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_permissions_a_root_open_to_others_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(UnsafeStoreError, match="chmod 700"):
        open_store(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_permissions_a_root_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(UnsafeStoreError, match="owned by uid 12345"):
        open_store(root)


@pytest.mark.parametrize(
    "where",
    ["magic", "version", "namespace", "hash", "tokens", "payload_start", "payload_end", "checksum"],
)
def test_corrupt_byte_is_a_miss_and_the_file_is_removed(tmp_path, where):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    path = store.path(key(1))
    data = bytearray(open(path, "rb").read())
    head = record.header_length(32, 16)
    offset = {
        "magic": 0,
        "version": 8,
        "namespace": 12,
        "hash": record.FIXED.size + 5,
        "tokens": record.FIXED.size + 32 + 3,
        "payload_start": head,
        "payload_end": len(data) - record.CHECKSUM_BYTES - 1,
        "checksum": len(data) - 1,
    }[where]
    data[offset] ^= 0x40
    with open(path, "r+b") as f:
        f.write(data)
    assert store.get(key(1), tokens(1)) is None
    assert not os.path.exists(path)
    stats = store.stats()
    assert stats.corrupt_dropped + stats.foreign_dropped == 1
    assert stats.misses == 1 and stats.hits == 0
    assert store.total_bytes == 0


@pytest.mark.parametrize("keep", [0, 10, record.FIXED.size + 40, -1])
def test_truncated_file_is_a_miss_and_the_file_is_removed(tmp_path, keep):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    path = store.path(key(1))
    size = os.path.getsize(path)
    os.truncate(path, keep % size)
    assert store.get(key(1), tokens(1)) is None
    assert not os.path.exists(path)
    assert store.stats().corrupt_dropped == 1


def test_a_file_with_bytes_appended_is_a_miss(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    with open(store.path(key(1)), "ab") as f:
        f.write(b"\0")
    out = bytearray(len(payload(1)))
    assert not store.get_into(key(1), tokens(1), out)
    assert not os.path.exists(store.path(key(1)))


def test_a_file_of_another_namespace_never_hits(tmp_path):
    theirs = open_store(tmp_path, namespace=OTHER_NAMESPACE)
    theirs.put(BlockWrite.at(key(1), tokens(1), payload(1, variant=9)))
    ours = open_store(tmp_path)
    assert not ours.contains(key(1))
    assert ours.get(key(1), tokens(1)) is None  # another directory: never looked at
    os.makedirs(os.path.dirname(ours.path(key(1))), exist_ok=True)
    shutil.copy2(theirs.path(key(1)), ours.path(key(1)))  # copied in by hand, times kept
    assert ours.contains(key(1))
    assert ours.get(key(1), tokens(1)) is None
    assert ours.stats().foreign_dropped == 1
    assert not os.path.exists(ours.path(key(1)))
    assert theirs.get(key(1), tokens(1)) == payload(1, variant=9)


def test_a_file_of_another_block_under_this_name_never_hits(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(2), tokens(1), payload(2)))
    os.makedirs(os.path.dirname(store.path(key(1))), exist_ok=True)
    os.replace(store.path(key(2)), store.path(key(1)))
    assert store.get(key(1), tokens(1)) is None
    assert store.stats().foreign_dropped == 1


def test_a_file_of_another_group_under_this_name_never_hits(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1, 1), tokens(1), payload(1, group=1)))
    os.replace(store.path(key(1, 1)), store.path(key(1, 0)))
    assert store.get(key(1, 0), tokens(1)) is None
    assert store.stats().foreign_dropped == 1


def test_token_id_mismatch_hash_collision_is_a_miss(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1, variant=0), payload(1)))
    assert store.get(key(1), tokens(1, variant=1)) is None
    assert store.stats().foreign_dropped == 1
    assert not store.contains(key(1))
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert store.get(key(1), tokens(1)[:-1]) is None  # another block size


def test_get_into_a_buffer_of_another_size_is_a_miss(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert not store.get_into(key(1), tokens(1), bytearray(len(payload(1)) - 1))


def test_a_symlink_under_a_record_name_is_never_followed(tmp_path):
    store = open_store(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    os.makedirs(os.path.dirname(store.path(key(1))), exist_ok=True)
    os.symlink(secret, store.path(key(1)))
    assert not store.contains(key(1))
    assert store.get(key(1), tokens(1)) is None
    assert not os.path.lexists(store.path(key(1)))
    assert secret.read_bytes() == b"x" * 100


def test_a_missing_file_is_a_plain_miss(tmp_path):
    store = open_store(tmp_path)
    assert store.get(key(1), tokens(1)) is None
    stats = store.stats()
    assert (stats.misses, stats.corrupt_dropped, stats.foreign_dropped) == (1, 0, 0)


def test_put_replaces_a_key_atomically_and_keeps_the_byte_total(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1, 1000)))
    size = store.put(BlockWrite.at(key(1), tokens(1), payload(1, 3000, variant=1)))
    assert store.get(key(1), tokens(1)) == payload(1, 3000, variant=1)
    assert store.total_bytes == size
    assert temp_files(tmp_path) == []


def test_a_failed_write_leaves_no_file_under_any_name(tmp_path, monkeypatch):
    store = open_store(tmp_path)

    def disk_full(fd, buffers):
        os.write(fd, b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("prefixserve.kv_store.disk_store.write_all", disk_full)
    with pytest.raises(OSError):
        store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert store.total_bytes == 0


def test_capacity_limit_respected_under_many_puts(tmp_path):
    capacity = 40_000
    store = open_store(tmp_path, capacity=capacity)
    for i in range(200):
        store.put(BlockWrite.at(key(i), tokens(i), payload(i, 1000 + (i % 7) * 300)))
        on_disk = sum(p.stat().st_size for p in record_files(tmp_path))
        assert on_disk <= capacity
        assert store.total_bytes == on_disk
    assert store.stats().evictions > 0
    assert store.get(key(199), tokens(199)) == payload(199, 1000 + (199 % 7) * 300)


def test_eviction_removes_the_least_recently_used_first(tmp_path):
    clock = FakeClock()
    size = open_store(tmp_path / "probe").put(BlockWrite.at(key(0), tokens(0), payload(0)))
    store = open_store(tmp_path / "s", capacity=4 * size, low_watermark=1.0, clock=clock)
    for i in range(4):
        clock.advance(1)
        store.put(BlockWrite.at(key(i), tokens(i), payload(i)))
    clock.advance(1)
    assert store.get(key(0), tokens(0)) == payload(0)  # 0 is now the most recent
    clock.advance(1)
    store.put(BlockWrite.at(key(4), tokens(4), payload(4)))
    assert [store.contains(key(i)) for i in range(5)] == [True, False, True, True, True]


def test_a_payload_larger_than_the_capacity_is_not_stored(tmp_path):
    store = open_store(tmp_path, capacity=500)
    assert store.put(BlockWrite.at(key(1), tokens(1), payload(1, 1000))) == 0
    assert record_files(tmp_path) == []


def test_capacity_covers_every_namespace_so_an_old_model_ages_out(tmp_path):
    clock = FakeClock()
    old = open_store(tmp_path, namespace=OTHER_NAMESPACE, clock=clock)
    size = old.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    clock.advance(1)
    new = open_store(tmp_path, capacity=2 * size, low_watermark=1.0, clock=clock)
    assert new.total_bytes == size
    for i in (2, 3):
        clock.advance(1)
        new.put(BlockWrite.at(key(i), tokens(i), payload(i)))
    assert not old.contains(key(1))
    assert new.contains(key(2)) and new.contains(key(3))


def test_eviction_never_raises_when_a_file_vanished_meanwhile(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    for i in range(5):
        store.put(BlockWrite.at(key(i), tokens(i), payload(i)))
    from prefixserve.kv_store import disk_store, scan

    real_scan = scan.scan_store

    def scan_then_delete(root, now_ns, collect):
        result = real_scan(root, now_ns, collect)
        for path in record_files(tmp_path):
            os.unlink(path)  # another process evicts everything after our scan
        return result

    monkeypatch.setattr(disk_store, "scan_store", scan_then_delete)
    assert store.evict(0) == 0
    assert store.total_bytes == 0


def test_rescan_counts_files_other_processes_wrote(tmp_path):
    ours = open_store(tmp_path)
    theirs = open_store(tmp_path)
    size = theirs.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    assert ours.total_bytes == 0
    assert ours.rescan() == size == ours.total_bytes
    assert ours.get(key(1), tokens(1)) == payload(1)


def test_expired_blocks_are_deleted_from_disk_by_sweep_expired(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1), expires_at=clock.now + 24 * 3600))
    store.put(BlockWrite.at(key(2), tokens(2), payload(2)))  # no expiry
    clock.advance(24 * 3600 - 1)
    assert store.sweep_expired() == 0
    assert store.contains(key(1))
    clock.advance(1)
    assert not store.contains(key(1))  # from a stat alone
    assert os.path.exists(store.path(key(1)))
    assert store.sweep_expired() == 1
    assert not os.path.exists(store.path(key(1)))
    assert store.get(key(2), tokens(2)) == payload(2)
    assert store.stats().expired_deleted == 1
    assert store.total_bytes == os.path.getsize(store.path(key(2)))


def test_expired_blocks_are_deleted_from_disk_by_get(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1), expires_at=clock.now + 10))
    assert store.get(key(1), tokens(1)) == payload(1)
    clock.advance(10)
    assert store.get(key(1), tokens(1)) is None
    assert not os.path.exists(store.path(key(1)))
    assert store.stats().expired_deleted == 1


def test_expired_blocks_are_deleted_when_the_store_is_opened(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1), expires_at=clock.now + 10))
    clock.advance(11)
    assert open_store(tmp_path, clock=clock).stats().expired_deleted == 1
    assert record_files(tmp_path) == []


def test_a_put_that_has_already_expired_writes_nothing(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    assert store.put(BlockWrite.at(key(1), tokens(1), payload(1), expires_at=clock.now - 1)) == 0
    assert record_files(tmp_path) == []


def test_a_hit_does_not_extend_the_expiry(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, clock=clock)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1), expires_at=clock.now + 10))
    clock.advance(5)
    assert store.get(key(1), tokens(1)) == payload(1)
    clock.advance(5)
    assert not store.contains(key(1))


def _exit_at_once() -> None:
    pass


def _dead_pid() -> int:
    process = multiprocessing.get_context("fork").Process(target=_exit_at_once)
    process.start()
    process.join()
    return process.pid


def test_writer_killed_mid_write_leftover_temp_file_is_cleaned_and_ignored(tmp_path):
    store = open_store(tmp_path)
    store.put(BlockWrite.at(key(1), tokens(1), payload(1)))
    shard = os.path.dirname(store.path(key(1)))
    final = os.path.basename(store.path(key(2)))
    dead = os.path.join(shard, f".{final}.{_dead_pid()}.0123abcd.tmp")
    live = os.path.join(shard, f".{final}.{os.getppid()}.0123abcd.tmp")  # a live writer's
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"PSKVBLK\0 half a record")
    reopened = open_store(tmp_path)
    assert not os.path.exists(dead) and os.path.exists(live)
    assert reopened.stats().temp_files_removed == 1
    assert reopened.total_bytes == os.path.getsize(store.path(key(1)))
    assert not reopened.contains(key(2)) and reopened.get(key(2), tokens(2)) is None
    assert reopened.get(key(1), tokens(1)) == payload(1)


def test_count_prefix_stops_at_the_first_block_missing_in_any_group(tmp_path):
    store = open_store(tmp_path)
    hashes = [key(i)[0] for i in range(4)]
    for i in range(3):
        store.put(BlockWrite.at(key(i, 0), tokens(i), payload(i)))
    for i in (0, 2):
        store.put(BlockWrite.at(key(i, 1), tokens(i), payload(i)))
    assert store.count_prefix(hashes, [0]) == 3
    assert store.count_prefix(hashes, [0, 1]) == 1
    assert store.count_prefix([], [0]) == 0


@pytest.mark.parametrize(
    "bad_key",
    [(b"", 0), ("ab", 0), (b"x" * 65, 0), (b"x", -1), (b"x", 1 << 16), (b"x", True)],
)
def test_bad_keys_are_refused_with_a_value_error(tmp_path, bad_key):
    store = open_store(tmp_path)
    with pytest.raises(ValueError):
        store.put(BlockWrite.at(bad_key, tokens(1), payload(1)))
    with pytest.raises(ValueError):
        store.contains(bad_key)


def test_bad_token_ids_and_arguments_are_refused(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="int32"):
        store.put(BlockWrite.at(key(1), [1 << 40], payload(1)))
    with pytest.raises(ValueError, match="namespace"):
        open_store(tmp_path, namespace="not-hex")
    with pytest.raises(ValueError, match="capacity"):
        open_store(tmp_path, capacity=0)
    with pytest.raises(ValueError, match="writable"):
        store.get_into(key(1), tokens(1), b"readonly")
