"""The router's index from replicas' event batches: keys computed by the router itself, copies,
removals, orphans, gaps healed by replay or snapshot, restarts, and registration checks."""

import pytest

from prefixserve.cluster.event_log import EventLog
from prefixserve.cluster.index import PrefixIndex
from prefixserve.cluster.messages import EventBatch, RegistrationError, ReplicaInfo
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved
from tests.helpers.router import BS, engine_hashes, stored


def info(rid=0, epoch=1, block_size=BS, algo="sha256", seed="s1"):
    return ReplicaInfo(rid, epoch, block_size, algo, seed, 100, 1024, None)


def feed(log, index, *events):
    batch = log.append(events)
    return index.apply(batch)


@pytest.fixture
def setup():
    index = PrefixIndex(BS, "sha256")
    index.register(info(0))
    index.register(info(1))
    return index, EventLog(0, 1), EventLog(1, 1)


PROMPT = list(range(100, 116))  # 4 blocks


def test_a_replica_holds_the_prefix_its_events_stored(setup):
    index, log0, _ = setup
    assert feed(log0, index, stored(PROMPT, 0, 3)) is None
    keys = index.prompt_keys(PROMPT)
    assert len(keys) == 4
    assert index.match(keys, now=0.0) == {0: 3, 1: 0}


def test_router_keys_do_not_depend_on_the_replicas_hash_seed(setup):
    index, log0, log1 = setup
    feed(log0, index, stored(PROMPT, seed=b"seed-a"))
    feed(log1, index, stored(PROMPT[:8], seed=b"seed-b"))
    assert index.match(index.prompt_keys(PROMPT), 0.0) == {0: 4, 1: 2}


def test_blocks_stored_in_several_events_chain_through_their_parents(setup):
    index, log0, _ = setup
    feed(log0, index, stored(PROMPT, 0, 1))
    feed(log0, index, stored(PROMPT, 1, 2))
    feed(log0, index, stored(PROMPT, 3, 1))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 4


def test_a_hash_stored_twice_stays_until_both_copies_are_removed(setup):
    index, log0, _ = setup
    hashes = engine_hashes(PROMPT)
    feed(log0, index, stored(PROMPT, 0, 2), stored(PROMPT, 0, 2))
    feed(log0, index, BlockRemoved([hashes[1]], 0))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 2
    feed(log0, index, BlockRemoved([hashes[1]], 0))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 1


def test_a_removed_middle_block_ends_the_contiguous_hit(setup):
    index, log0, _ = setup
    feed(log0, index, stored(PROMPT))
    feed(log0, index, BlockRemoved([engine_hashes(PROMPT)[1]], 0))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 1


def test_removing_an_unknown_hash_is_counted_and_harmless(setup):
    index, log0, _ = setup
    feed(log0, index, BlockRemoved([b"never-stored"], 0))
    assert index.stats.unknown_removals == 1


def test_a_block_whose_parent_is_unknown_waits_for_it(setup):
    index, log0, _ = setup
    feed(log0, index, stored(PROMPT, 2, 2))  # its parent (block 1) not seen yet
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 0
    assert index.stats.orphans == 2  # block 3 waits for block 2, which waits for block 1
    feed(log0, index, stored(PROMPT, 0, 2))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 4


def test_orphans_are_bounded():
    index = PrefixIndex(BS, "sha256", max_orphans=2)
    index.register(info(0))
    log = EventLog(0, 1)
    for start in range(10):
        tokens = list(range(start * 1000, start * 1000 + 8))
        feed(log, index, stored(tokens, 1, 1))
    assert index.stats.dropped_orphans == 8


def test_all_blocks_cleared_empties_that_replica_only(setup):
    index, log0, log1 = setup
    feed(log0, index, stored(PROMPT))
    feed(log1, index, stored(PROMPT))
    feed(log0, index, AllBlocksCleared())
    assert index.match(index.prompt_keys(PROMPT), 0.0) == {0: 0, 1: 4}


def test_tenants_are_never_routed_by_another_tenants_blocks(setup):
    index, log0, _ = setup
    feed(log0, index, stored(PROMPT, salt="tenant-a"))
    assert index.match(index.prompt_keys(PROMPT, cache_salt="tenant-a"), 0.0)[0] == 4
    assert index.match(index.prompt_keys(PROMPT, cache_salt="tenant-b"), 0.0)[0] == 0
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 0


def test_a_duplicate_batch_is_dropped(setup):
    index, log0, _ = setup
    batch = log0.append([stored(PROMPT)])
    assert index.apply(batch) is None
    assert index.apply(batch) is None
    assert index.stats.duplicates == 1
    assert index.num_blocks(0) == 4


def test_a_gap_asks_for_a_replay_and_the_replay_heals_it(setup):
    index, log0, _ = setup
    lost = log0.append([stored(PROMPT, 0, 2)])
    after = log0.append([stored(PROMPT, 2, 2)])
    assert lost.seq == 0
    assert index.apply(after) == 0  # batch 0 is missing: nothing applied
    assert index.num_blocks(0) == 0
    for batch in log0.replay(0):
        assert index.apply(batch) is None
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 4
    assert index.apply(after) is None  # the pushed copy arrives late: a duplicate
    assert index.stats.gaps == 1


def test_a_snapshot_heals_a_gap_the_ring_no_longer_holds():
    index = PrefixIndex(BS, "sha256")
    index.register(info(0))
    log = EventLog(0, 1, ring_batches=2)
    hashes = engine_hashes(PROMPT)
    log.append([stored(PROMPT)])
    log.append([BlockRemoved([hashes[3]], 0)])
    last = log.append([stored(list(range(500, 508)))])
    assert index.apply(last) == 0
    assert log.replay(0) is None  # overrun
    index.apply_snapshot(log.snapshot())
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 3
    assert index.match(index.prompt_keys(list(range(500, 508))), 0.0)[0] == 2
    assert index.next_seq(0) == 3


def test_a_snapshot_lists_children_whose_parent_was_evicted_without_breaking():
    index = PrefixIndex(BS, "sha256")
    index.register(info(0))
    log = EventLog(0, 1)
    hashes = engine_hashes(PROMPT)
    log.append([stored(PROMPT), BlockRemoved([hashes[0]], 0)])
    index.apply_snapshot(log.snapshot())
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 0
    log.append([stored(PROMPT, 0, 1)])  # the parent comes back: its children hit again
    index.apply(log.replay(1)[0])
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 4


def test_a_newer_epoch_forgets_the_old_process_and_an_older_one_is_stale(setup):
    index, log0, _ = setup
    feed(log0, index, stored(PROMPT))
    restarted = EventLog(0, 2)
    assert index.apply(restarted.append([stored(PROMPT[:4])])) is None
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 1
    assert index.epoch(0) == 2
    assert index.apply(log0.append([stored(PROMPT)])) is None
    assert index.stats.stale == 1
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 1


def test_pending_keys_count_until_confirmed_or_expired():
    index = PrefixIndex(BS, "sha256", pending_ttl_s=10.0)
    index.register(info(0))
    keys = index.prompt_keys(PROMPT)
    index.insert_pending(0, keys, now=100.0)
    assert index.match(keys, now=105.0)[0] == 4
    assert index.match(keys, now=111.0)[0] == 0
    index.insert_pending(0, keys, now=200.0)
    feed(EventLog(0, 1), index, stored(PROMPT, 0, 2))
    assert index.match(keys, now=300.0)[0] == 2  # confirmed ones stay, the rest expired


def test_registration_refuses_another_block_size_hash_or_seed():
    index = PrefixIndex(BS, "sha256")
    index.register(info(0, seed="s1"))
    with pytest.raises(RegistrationError, match="16-token|blocks of 16"):
        index.register(info(1, block_size=16))
    with pytest.raises(RegistrationError, match="xxhash"):
        index.register(info(1, algo="xxhash"))
    with pytest.raises(RegistrationError, match="seed"):
        index.register(info(1, seed="s2"))
    index.register(info(1, seed="s1"))
    index.register(info(0, epoch=5, seed="s1"))  # the same replica again, restarted
    assert index.epoch(0) == 5


def test_batches_of_an_unregistered_replica_are_ignored():
    index = PrefixIndex(BS, "sha256")
    assert index.apply(EventBatch(7, 1, 0, (stored(PROMPT),))) is None
    assert index.replica_ids == []


def test_event_log_numbers_batches_and_replays_what_its_ring_holds():
    log = EventLog(3, 9, ring_batches=2)
    assert log.append([]) is None  # nothing to send: no batch, no seq used
    batches = [log.append([stored(PROMPT, i, 1)]) for i in range(3)]
    assert [(b.replica_id, b.epoch, b.seq) for b in batches] == [(3, 9, 0), (3, 9, 1), (3, 9, 2)]
    assert log.replay(3) == []
    assert log.replay(1) == batches[1:]
    assert log.replay(0) is None
    snapshot = log.snapshot()
    assert (snapshot.next_seq, len(snapshot.blocks)) == (3, 3)
    assert [b.parent_hash for b in snapshot.blocks][1:] == engine_hashes(PROMPT)[:2]


def test_an_orphan_evicted_before_its_parent_arrives_is_not_installed(setup):
    index, log0, _ = setup
    hashes = engine_hashes(PROMPT)
    feed(log0, index, stored(PROMPT, 1, 1))  # block 1 waits for block 0
    feed(log0, index, BlockRemoved([hashes[1]], 0))  # ... and is evicted meanwhile
    assert index.stats.unknown_removals == 0
    feed(log0, index, stored(PROMPT, 0, 1))
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 1


def test_an_older_snapshot_of_the_same_epoch_is_ignored(setup):
    index, log0, _ = setup
    old = log0.snapshot()  # as of seq 0: nothing cached
    feed(log0, index, stored(PROMPT))
    index.apply_snapshot(old)
    assert index.match(index.prompt_keys(PROMPT), 0.0)[0] == 4
