"""What a replicated server shows at /kv_events (the feed's sink), and when the router may price
the replicas' shared disk store (store_probe.open_store_probe). No Ray: the feed is driven
directly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from prefixserve.cluster import route_inputs
from prefixserve.cluster.event_feed import EventFeed
from prefixserve.cluster.event_log import EventLog
from prefixserve.cluster.index import PromptView
from prefixserve.cluster.messages import ReplicaInfo, StoreInfo, seed_fingerprint
from prefixserve.cluster.policy import make_policy
from prefixserve.cluster.route_inputs import LoraDigests
from prefixserve.cluster.router import Router
from prefixserve.cluster.store_probe import open_store_probe
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockStored
from prefixserve.core.kv_cache.hashing import get_request_block_hasher, none_hash_from_secret
from prefixserve.kv_store import DiskKVStore, load_or_create_seed
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.tier_key import TierKey
from tests.helpers.router import BS, stored

NAMESPACE = "ab" * 16


def info(rid: int = 0, epoch: int = 1, seed: str = "s1", store: StoreInfo | None = None):
    return ReplicaInfo(rid, epoch, BS, "sha256", seed, 100, 1024, store)


def feed_with_sink() -> tuple[EventFeed, list[tuple[int, list]]]:
    router = Router(BS, "sha256", make_policy("prefix", 0))
    router.register(info())
    got: list[tuple[int, list]] = []
    feed = EventFeed(0, None, router, sink=lambda rid, events: got.append((rid, list(events))))
    return feed, got


def test_applied_batches_reach_the_sink_and_duplicates_do_not() -> None:
    feed, got = feed_with_sink()
    log = EventLog(0, 1)
    batch = log.append([stored(list(range(8)))])
    assert feed._apply(batch) is None
    feed._apply(batch)  # a duplicate: the index drops it, and so does the sink
    assert got == [(0, list(batch.events))]


def test_a_snapshot_reaches_the_sink_as_a_clear_then_each_cached_copy() -> None:
    feed, got = feed_with_sink()
    log = EventLog(0, 1)
    event = stored(list(range(8)))
    log.append([event, event])  # two copies of the same two blocks
    feed._apply_snapshot(log.snapshot())
    ((rid, events),) = got
    assert rid == 0 and isinstance(events[0], AllBlocksCleared)
    blocks = events[1:]
    assert all(isinstance(e, BlockStored) for e in blocks)
    assert [e.block_hashes[0] for e in blocks] == [h for h in event.block_hashes for _ in (0, 1)]
    assert blocks[2].parent_block_hash == event.block_hashes[0]
    assert blocks[2].token_ids == list(range(4, 8))
    got.clear()
    feed._apply_snapshot(EventLog(0, 1).snapshot())  # older than what the index has: ignored
    assert got == []


def test_a_replica_that_goes_down_is_cleared_at_the_sink() -> None:
    feed, got = feed_with_sink()
    feed._down()
    assert got == [(0, [AllBlocksCleared()])]
    assert feed.synced.is_set()  # nobody waits for a replica that is down


def _store(tmp_path: Path) -> tuple[StoreInfo, bytes]:
    root = tmp_path / "store"
    none_hash = none_hash_from_secret(load_or_create_seed(root), "sha256")
    return StoreInfo(str(root), NAMESPACE), none_hash


def test_the_store_is_priced_only_when_every_replica_shares_one_this_host_sees(
    tmp_path: Path,
) -> None:
    store, none_hash = _store(tmp_path)
    seed = seed_fingerprint(none_hash)
    assert (
        open_store_probe([info(0, seed=seed, store=store), info(1, seed=seed)], BS, "sha256")
        is None
    )
    other = StoreInfo(str(tmp_path / "elsewhere"), NAMESPACE)
    assert open_store_probe([info(0, seed=seed, store=other)], BS, "sha256") is None  # not here
    two = [info(0, seed=seed, store=store), info(1, seed=seed, store=other)]
    assert open_store_probe(two, BS, "sha256") is None
    assert open_store_probe([info(0, seed="not-its-seed", store=store)], BS, "sha256") is None
    probe = open_store_probe([info(0, seed=seed, store=store)], BS, "sha256")
    assert probe is not None

    # Two of a prompt's three blocks written, as a replica's engine hashes them.
    disk = DiskKVStore(store.dir, NAMESPACE, 1 << 20)
    tokens = list(range(12))
    hashes = get_request_block_hasher(BS, "sha256", none_hash=none_hash)(PromptView(tokens))
    for block_hash, first in zip(hashes[:2], (0, 4), strict=True):
        disk.put(BlockWrite.at((block_hash, 0), tokens[first : first + BS], b"\0" * 64))
    assert probe(PromptView(tokens)).count_from(0) == 2
    assert probe(PromptView(tokens)).count_from(1) == 1
    assert probe(PromptView(tokens)).count_from(2) == 0
    assert probe(PromptView(tokens, cache_salt="another tenant")).count_from(0) == 0
    os.unlink(disk.path((hashes[0], 0)))
    run = probe(PromptView(tokens))
    assert run.count_from(0) == 0  # contiguous from where it starts
    assert run.count_from(1) == 1  # a replica holding block 0 in RAM loads block 1


def test_the_router_gives_each_replica_the_store_blocks_past_what_it_holds() -> None:
    class Blocks:
        def count_from(self, first: int) -> int:
            return max(0, 3 - first)  # the store holds blocks 0-2

    router = Router(BS, "sha256", make_policy("prefix", 0))
    router.register(info(0))
    router.register(info(1))
    tokens = list(range(16))
    router.index.insert_pending(0, router.index.prompt_keys(tokens)[:2], time.monotonic())
    seen: list[list[tuple[int, int, int]]] = []
    policy_choose = router.policy.choose

    def choose(request, candidates):
        seen.append([(c.replica_id, c.cached_blocks, c.store_blocks) for c in candidates])
        return policy_choose(request, candidates)

    router.policy.choose = choose
    router.store_probe = lambda view: Blocks()
    router.route(tokens)
    assert seen == [[(0, 2, 1), (1, 0, 3)]]
    assert router.store_lookups == 1


def test_lora_digests_are_read_once_per_version_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    monkeypatch.setattr(route_inputs, "adapter_digest", lambda root: reads.append(root) or b"d")
    monkeypatch.setattr(route_inputs, "MAX_LORA_DIGESTS", 2)
    digests = LoraDigests()
    assert digests.get(str(tmp_path / "missing")) is None
    paths = []
    for i in range(3):
        root = tmp_path / f"adapter{i}"
        root.mkdir()
        for name in route_inputs.ADAPTER_FILES:
            (root / name).write_bytes(b"x")
        paths.append(str(root))
        assert digests.get(str(root)) == b"d"
    assert digests.get(paths[2]) == b"d" and len(reads) == 3  # cached
    assert len(digests._digests) == 2  # the oldest went
    assert digests.get(paths[0]) == b"d" and len(reads) == 4
    (Path(paths[2]) / "adapter_model.safetensors").write_bytes(b"changed")
    digests.get(paths[2])
    assert len(reads) == 5  # a new version of the files is read again


def test_the_store_is_priced_with_the_shared_tiers_seed_when_the_replicas_chain_from_it(
    tmp_path: Path,
) -> None:
    """Replicas with a shared tier across hosts chain from its seed, not the store's file: the
    router prices their store with that seed (remote_probe.py reads it from the server)."""
    store, _ = _store(tmp_path)
    shared = none_hash_from_secret(b"s" * 32, "sha256")
    replicas = [info(0, seed=seed_fingerprint(shared), store=store)]
    assert open_store_probe(replicas, BS, "sha256") is None  # the store's own seed: not theirs
    probe = open_store_probe(replicas, BS, "sha256", none_hash=shared)
    assert probe is not None
    disk = DiskKVStore(store.dir, NAMESPACE, 1 << 20)
    tokens = list(range(8))
    hashes = get_request_block_hasher(BS, "sha256", none_hash=shared)(PromptView(tokens))
    disk.put(BlockWrite.at((hashes[0], 0), tokens[:BS], b"\0" * 64))
    assert probe(PromptView(tokens)).count_from(0) == 1


def test_a_store_with_a_key_is_priced_with_the_seed_of_its_key_file(tmp_path: Path) -> None:
    """Replicas whose disk tier has `--kv-store-key-file` chain from the key's seed (their store
    has no seed file): the router reads the key file at the replicas' path and prices the
    store's records, MACed or not (a stat is all it does)."""
    key_file = tmp_path / "disk.key"
    key_file.write_text("a disk key of 32 bytes or more, for the router\n")
    key_file.chmod(0o600)
    key = TierKey.from_file(key_file, "--kv-store-key-file")
    root = tmp_path / "store"
    disk = DiskKVStore(root, NAMESPACE, 1 << 20, key=key)
    none_hash = none_hash_from_secret(key.seed, "sha256")
    store = StoreInfo(str(root), NAMESPACE, str(key_file))
    probe = open_store_probe([info(0, seed=seed_fingerprint(none_hash), store=store)], BS, "sha256")
    assert probe is not None and not (root / "seed").exists()
    tokens = list(range(8))
    hashes = get_request_block_hasher(BS, "sha256", none_hash=none_hash)(PromptView(tokens))
    disk.put(BlockWrite.at((hashes[0], 0), tokens[:BS], b"\0" * 64))
    assert probe(PromptView(tokens)).count_from(0) == 1
    elsewhere = StoreInfo(str(root), NAMESPACE, str(tmp_path / "missing.key"))
    fingerprint = seed_fingerprint(none_hash)
    assert open_store_probe([info(0, seed=fingerprint, store=elsewhere)], BS, "sha256") is None
