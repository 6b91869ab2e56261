"""Routing policies on exact small cases, and the router's load bookkeeping."""

import random

import pytest

from prefixserve.cluster.event_log import EventLog
from prefixserve.cluster.messages import ReplicaInfo
from prefixserve.cluster.policy import (
    DECODE_TOKENS,
    MISS_WEIGHT,
    Candidate,
    PrefixAware,
    PrefixTree,
    ReplicaLoad,
    RouteInput,
    make_policy,
)
from prefixserve.cluster.router import NoReplicaError, Router
from prefixserve.core.kv_cache.events import BlockStored
from prefixserve.core.kv_cache.hashing import hash_block_tokens

BS = 16


def req(tokens=1024, keys=None, cache_key=None):
    return RouteInput(tokens, BS, keys or [], cache_key)


def cand(rid, cached=0, queued=0, running=0, store=0, in_flight=0):
    return Candidate(rid, ReplicaLoad(in_flight, queued, running), cached, store)


def test_prefix_policy_prefers_the_replica_holding_the_prefix():
    policy = PrefixAware(random.Random(0))
    assert policy.choose(req(), [cand(0), cand(1, cached=32), cand(2, cached=8)]) == 1


def test_prefix_policy_weighs_a_cached_prefix_against_load():
    policy = PrefixAware(random.Random(0))
    saved = MISS_WEIGHT * 512  # replica 1 holds 32 blocks: 512 tokens it need not compute
    assert policy.choose(req(), [cand(0), cand(1, cached=32, queued=saved + 1)]) == 0
    assert policy.choose(req(), [cand(0), cand(1, cached=32, queued=saved - 1)]) == 1
    # Running decodes count DECODE_TOKENS each.
    busy = saved // DECODE_TOKENS + 1
    assert policy.choose(req(), [cand(0), cand(1, cached=32, running=busy)]) == 0


def test_prefix_policy_counts_store_blocks_cheaper_than_computing_dearer_than_held():
    policy = PrefixAware(random.Random(0))
    assert policy.choose(req(), [cand(0), cand(1, store=32)]) == 1
    assert policy.choose(req(), [cand(0, cached=32), cand(1, store=32)]) == 0


def test_ties_follow_the_prompt_cache_key_consistently():
    policy = PrefixAware(random.Random(0))
    choices = {
        policy.choose(req(cache_key="user-42"), [cand(0), cand(1), cand(2)]) for _ in range(20)
    }
    assert len(choices) == 1
    spread = {
        policy.choose(req(cache_key=f"user-{i}"), [cand(0), cand(1), cand(2)]) for i in range(30)
    }
    assert spread == {0, 1, 2}


def test_ties_without_a_key_are_broken_at_random():
    policy = PrefixAware(random.Random(0))
    assert {policy.choose(req(), [cand(0), cand(1)]) for _ in range(40)} == {0, 1}


def test_round_robin_cycles_whatever_the_cache():
    policy = make_policy("round_robin")
    assert [policy.choose(req(), [cand(0, cached=64), cand(1)]) for _ in range(4)] == [0, 1, 0, 1]


def test_least_loaded_and_power_of_two_take_the_lighter_replica():
    assert make_policy("least_loaded").choose(req(), [cand(0, queued=10), cand(1)]) == 1
    p2c = make_policy("power_of_two", seed=1)
    # Of any two sampled, the lighter wins: replica 2 (the heaviest) never does.
    picks = {
        p2c.choose(req(), [cand(0, queued=5), cand(1, queued=1), cand(2, queued=9)])
        for _ in range(50)
    }
    assert 2 not in picks


def test_prefix_tree_follows_its_routing_history_then_falls_back_to_load():
    policy = PrefixTree(random.Random(0))
    keys = [bytes([i]) for i in range(8)]
    policy.routed(req(keys=keys), 1)
    assert policy.choose(req(keys=keys), [cand(0), cand(1, queued=50)]) == 1
    other = [bytes([100 + i]) for i in range(8)]
    assert policy.choose(req(keys=other), [cand(0), cand(1, queued=50)]) == 0
    policy.forget(1)
    assert policy.choose(req(keys=keys), [cand(0), cand(1, queued=50)]) == 0


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="least_loaded.*power_of_two.*prefix"):
        make_policy("fastest")


def replica(rid, seed="s"):
    return ReplicaInfo(rid, 1, BS, "sha256", seed, 100, 4096, None)


def stored_event(tokens):
    hashes, parent = [], b"seed"
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens("sha256", parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return BlockStored(hashes, None, tokens[: len(hashes) * BS], BS, None, [None] * len(hashes), 0)


def test_router_routes_to_the_cached_replica_and_counts_its_load():
    router = Router(BS, "sha256", make_policy("prefix", seed=0))
    router.register(replica(0))
    router.register(replica(1))
    prompt = list(range(1000, 1000 + 640))
    router.index.apply(EventLog(1, 1).append([stored_event(prompt)]))
    route = router.route(prompt + [7] * 20)
    assert route.replica_id == 1 and route.cached_blocks == 40
    assert router.loads[1].queued_prefill_tokens == 20
    router.first_output(route)
    assert (router.loads[1].queued_prefill_tokens, router.loads[1].running) == (0, 1)
    router.finished(route)
    router.finished(route)  # idempotent
    assert router.loads[1] == ReplicaLoad()
    assert router.decisions == 1 and router.decision_seconds > 0


def test_routed_prefixes_are_pending_on_their_replica_until_events_come():
    router = Router(BS, "sha256", make_policy("prefix", seed=0))
    router.register(replica(0))
    router.register(replica(1))
    prompt = list(range(2000, 2000 + 320))
    first = router.route(prompt)
    # The second copy of the prompt goes where the first went, before any event arrived.
    second = router.route(prompt)
    assert second.replica_id == first.replica_id and second.cached_blocks == 20


def test_router_skips_replicas_at_their_cap_and_excluded_ones():
    router = Router(BS, "sha256", make_policy("prefix", seed=0), max_in_flight=1)
    router.register(replica(0))
    router.register(replica(1))
    a = router.route(list(range(64)))
    b = router.route(list(range(64)))
    assert {a.replica_id, b.replica_id} == {0, 1}
    c = router.route(list(range(500, 564)), exclude={b.replica_id})
    assert c.replica_id == a.replica_id  # every replica at its cap: the cap is not a wall
    with pytest.raises(NoReplicaError):
        router.route(list(range(64)), exclude={0, 1})


def test_a_removed_replica_gets_nothing_until_it_registers_again():
    router = Router(BS, "sha256", make_policy("round_robin"))
    router.register(replica(0))
    router.register(replica(1))
    router.remove(1)
    assert {router.route(list(range(32))).replica_id for _ in range(4)} == {0}
    router.register(replica(1))
    assert {router.route(list(range(32))).replica_id for _ in range(4)} == {0, 1}


def test_a_request_is_settled_against_the_load_it_was_counted_in_across_a_restart():
    """A request sent to a replica that then died and came back ends later: the replica's load
    is settled, never driven negative."""
    router = Router(BS, "sha256", make_policy("round_robin"))
    router.register(replica(0))
    route = router.route(list(range(64)))
    router.remove(0)
    router.register(ReplicaInfo(0, 2, BS, "sha256", "s", 100, 4096, None))  # a new epoch
    router.first_output(route)
    router.finished(route)
    assert router.loads[0] == ReplicaLoad()
