"""Rules of the store's secret seed (prefixserve/kv_store/seed.py)."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from prefixserve.kv_store.fs import UnsafeStoreError
from prefixserve.kv_store.seed import SEED_BYTES, SeedError, load_or_create_seed


def test_seed_is_created_once_0600_in_a_0700_root_and_then_reused(tmp_path):
    root = tmp_path / "a" / "store"
    seed = load_or_create_seed(root)
    assert len(seed) == SEED_BYTES
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "seed").st_mode) == 0o600
    assert load_or_create_seed(root) == seed
    assert load_or_create_seed(tmp_path / "other") != seed
    assert sorted(p.name for p in root.iterdir()) == ["seed"]


def test_seed_readable_by_group_or_others_is_refused(tmp_path):
    load_or_create_seed(tmp_path / "s")
    for mode in (0o640, 0o604, 0o620):
        os.chmod(tmp_path / "s" / "seed", mode)
        with pytest.raises(SeedError, match="chmod 600"):
            load_or_create_seed(tmp_path / "s")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_seed_owned_by_another_user_is_refused(tmp_path):
    load_or_create_seed(tmp_path / "s")
    os.chown(tmp_path / "s" / "seed", 12345, 12345)
    with pytest.raises(SeedError, match="owned by uid 12345"):
        load_or_create_seed(tmp_path / "s")


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_seed_of_the_wrong_length_is_refused(tmp_path, length):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    path = root / "seed"
    path.write_bytes(b"k" * length)
    os.chmod(path, 0o600)
    os.utime(path, (0, 0))  # not a seed being written right now
    with pytest.raises(SeedError, match=f"has {min(length, SEED_BYTES + 1)} bytes"):
        load_or_create_seed(root)


def test_seed_that_is_a_symlink_is_refused(tmp_path):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"k" * SEED_BYTES)
    os.chmod(target, 0o600)
    os.symlink(target, root / "seed")
    with pytest.raises(SeedError, match="symbolic link"):
        load_or_create_seed(root)


def test_seed_root_open_to_others_is_refused(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    os.chmod(root, 0o755)
    with pytest.raises(UnsafeStoreError, match="chmod 700"):
        load_or_create_seed(root)


def test_seed_temp_file_left_by_a_killed_creator_is_removed(tmp_path):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    stale = root / ".seed.999999999.0123abcd.tmp"  # a pid that cannot be alive
    stale.write_bytes(b"k" * 7)
    seed = load_or_create_seed(root)
    assert not stale.exists()
    assert len(seed) == SEED_BYTES


def _create_seed(root, barrier, results):
    barrier.wait()
    results.put(load_or_create_seed(root))


def test_seed_race_between_processes_all_get_the_same_seed(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        root = tmp_path / f"store{attempt}"
        barrier = ctx.Barrier(4)
        results = ctx.Queue()
        processes = [
            ctx.Process(target=_create_seed, args=(root, barrier, results)) for _ in range(4)
        ]
        for process in processes:
            process.start()
        seeds = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        assert len(set(seeds)) == 1
        assert seeds[0] == load_or_create_seed(root)
        assert sorted(p.name for p in root.iterdir()) == ["seed"]


def test_seed_on_a_filesystem_without_hard_links_is_created_directly(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    seed = load_or_create_seed(tmp_path / "s")
    assert load_or_create_seed(tmp_path / "s") == seed
    assert stat.S_IMODE(os.stat(tmp_path / "s" / "seed").st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["seed"]
