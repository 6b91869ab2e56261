"""Reads of the tiers below RAM overlap the running requests' compute (kv_store/loads.py
`BackgroundLoads`, `KVStoreConnector.start_load`): a request whose blocks a tier holds waits
while they are read on their own thread and the running requests keep stepping, then runs with
the bytes in hand; its outputs are a cold start's, bit for bit. Nothing running: the
step waits for the read. An abort or a reset while a read is held leaves nothing behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.core.request import RequestStatus
from prefixserve.kv_store.loads import BackgroundLoads
from tests.helpers.valkey import Server

BLOCK = 16
PROMPT = "The history of the printing press begins in the fifteenth century. " * 8
OTHER = "A recipe for bread needs flour, water, salt and a little patience before baking. " * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---- the bounded reads on their own thread


def test_loads_are_bounded_and_a_refused_load_is_counted():
    loads: BackgroundLoads[int] = BackgroundLoads(max_jobs=2)
    gate = threading.Event()
    assert loads.submit("a", lambda: gate.wait(10) and 1)
    assert loads.submit("b", lambda: 2)
    assert not loads.submit("c", lambda: 3)  # two held: the caller reads itself
    assert loads.refused == 1 and loads.submitted == 2
    assert loads.pending("a") and loads.result("a") is None
    gate.set()
    assert loads.result("a", timeout=None) == 1
    assert loads.result("a") == 1  # kept until discarded
    loads.discard("a")
    assert not loads.held("a") and loads.submit("c", lambda: 3)
    with pytest.raises(ValueError, match="already held"):
        loads.submit("c", lambda: 4)
    loads.clear()
    assert len(loads) == 0
    loads.close()
    assert not loads.submit("d", lambda: 5)


def test_a_read_that_raised_raises_on_the_callers_thread_and_is_forgotten():
    loads: BackgroundLoads[int] = BackgroundLoads()

    def broken() -> int:
        raise OSError("disk gone")

    assert loads.submit("a", broken)
    with pytest.raises(OSError, match="disk gone"):
        loads.result("a", timeout=None)
    assert not loads.held("a")
    loads.close()


# ---- in a real engine over a disk tier (or the shared tier on a real Valkey server)


def _llm(model, store: Path | None, remote: Server | None = None, **kwargs) -> LLM:
    tiers: dict = {"enable_kv_store": store is not None}
    if store is not None:
        tiers.update(kv_store_dir=str(store), kv_store_gb=0.25)
    if remote is not None:
        tiers.update(kv_remote=remote.url, kv_remote_key_file=str(remote.key_file))
    return LLM(dtype=model.config.dtype, loaded_model=model, num_kv_blocks=96, **tiers, **kwargs)


def _stored(model, store: Path | None, remote: Server | None = None) -> list[int]:
    """PROMPT computed once and written to the tier at `store` (or `remote`); its greedy
    tokens."""
    writer = _llm(model, store, remote)
    tokens = list(writer.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    writer.llm_engine.close()
    return tokens


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.llm_engine.tokenizer.encode(text)


def _run_to_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens


def _loadable(num_prompt_tokens: int) -> int:
    return BLOCK * ((num_prompt_tokens - 1) // BLOCK)


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_tier_hit_waits_for_its_read_while_the_running_request_steps(
    tier, default_model_exact, tmp_path, request
):
    store, remote = tmp_path, None
    if tier == "remote":
        pytest.importorskip("redis")
        store, remote = None, request.getfixturevalue("valkey_server")
    expected = _stored(default_model_exact, store, remote)
    llm = _llm(default_model_exact, store, remote)
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    engine.add_request("running", _ids(llm, OTHER), LONG)
    engine.step()
    prompt = _ids(llm, PROMPT)
    engine.add_request("hit", prompt, GREEDY)
    outputs = engine.step()  # starts the read and steps the running request alone
    assert [o.request_id for o in outputs] == ["running"]
    hit = engine.scheduler.requests["hit"]
    assert hit.status == RequestStatus.WAITING and connector._loads.held("hit")
    assert connector._loads.submitted == 1
    tokens = _run_to_end(engine)
    assert tokens["hit"] == expected
    assert hit.num_cached_tokens == hit.cache.num_disk_cached_tokens == _loadable(len(prompt))
    loaded = connector.stats.hit_tokens + connector.stats.remote_hit_tokens
    assert loaded == hit.num_cached_tokens
    assert (connector.stats.remote_hit_tokens > 0) is (tier == "remote")
    assert len(connector._loads) == 0
    engine.check_no_leaks()
    engine.close()


def test_without_overlap_or_with_nothing_running_the_hit_runs_in_its_first_step(
    default_model_exact, tmp_path
):
    expected = _stored(default_model_exact, tmp_path)
    for overlap in (False, True):
        llm = _llm(default_model_exact, tmp_path, kv_load_overlap=overlap)
        engine = llm.llm_engine
        assert engine.kv_connector.overlap_loads is overlap
        if not overlap:
            engine.add_request("running", _ids(llm, OTHER), LONG)
            engine.step()
        prompt = _ids(llm, PROMPT)
        engine.add_request("hit", prompt, GREEDY)
        first = engine.step()  # read at admission: the hit computes its last block now
        assert "hit" in [o.request_id for o in first]
        assert engine.kv_connector._loads.submitted == 0
        tokens = _run_to_end(engine)
        assert tokens["hit"] == expected
        engine.check_no_leaks()
        engine.close()


def test_an_abort_or_a_reset_while_a_read_is_held_leaves_nothing_behind(
    default_model_exact, tmp_path
):
    expected = _stored(default_model_exact, tmp_path)
    llm = _llm(default_model_exact, tmp_path)
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    engine.add_request("running", _ids(llm, OTHER), LONG)
    engine.step()
    engine.add_request("aborted", _ids(llm, PROMPT), GREEDY)
    engine.step()
    assert connector._loads.held("aborted")
    engine.abort_request("aborted")
    assert not connector._loads.held("aborted")

    engine.add_request("reset", _ids(llm, PROMPT), GREEDY)
    engine.step()
    assert connector._loads.held("reset")
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert len(connector._loads) == 0  # what was read before the reset is not served
    tokens = _run_to_end(engine)
    assert tokens["reset"] == expected
    engine.check_no_leaks()
    engine.close()


# ---- which reads overlap: those measured to outlast a step


def test_a_read_overlaps_only_when_it_was_measured_to_outlast_a_step():
    from prefixserve.core.kv_cache.tier_hit import TierHit
    from prefixserve.kv_store.load_speeds import LoadSpeeds
    from prefixserve.kv_store.tier import DISK, REMOTE

    speeds = LoadSpeeds()
    hit = TierHit(disk_tokens=4 * BLOCK, remote_tokens=6 * BLOCK)
    assert speeds.read_outlasts_a_step(hit, BLOCK)  # nothing measured: overlap
    speeds.record_step(0.010)
    assert speeds.read_outlasts_a_step(hit, BLOCK)  # the tiers not measured yet
    speeds.record_load(DISK, 0.004, 4)  # 1 ms a block
    speeds.record_load(REMOTE, 0.003, 6)  # 0.5 ms a block
    assert not speeds.read_outlasts_a_step(hit, BLOCK)  # 4 + 3 ms < a 10 ms step
    assert speeds.read_outlasts_a_step(TierHit(remote_tokens=30 * BLOCK), BLOCK)  # 15 ms
    assert not speeds.read_outlasts_a_step(TierHit(disk_tokens=9 * BLOCK), BLOCK)
    # A tier that serves none of the hit needs no measure.
    fresh = LoadSpeeds()
    fresh.record_step(0.010)
    fresh.record_load(DISK, 0.001, 1)
    assert not fresh.read_outlasts_a_step(TierHit(disk_tokens=2 * BLOCK), BLOCK)
    assert fresh.read_outlasts_a_step(TierHit(disk_tokens=BLOCK, remote_tokens=BLOCK), BLOCK)


def test_a_read_whose_blocks_came_into_ram_meanwhile_is_dropped_at_admission(
    default_model_exact, tmp_path
):
    """While A's read runs, another tenant's request computes the same prompt (prompt logprobs
    skip the cache read, so it never reads a tier): A is admitted on RAM hits, and its read is
    dropped then, not held for the rest of its run."""
    model = default_model_exact
    expected = _stored(model, tmp_path)
    llm = _llm(model, tmp_path, scheduling_policy="fair")
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    engine.add_request("running", _ids(llm, OTHER), LONG, tenant="r")
    engine.step()
    prompt = _ids(llm, PROMPT)
    engine.add_request("a", prompt, GREEDY, tenant="a")
    with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    engine.add_request("c", prompt, with_prompt_logprobs, tenant="c")
    engine.step()  # a's read starts; c computes the whole prompt
    assert connector._loads.held("a")
    a = engine.scheduler.requests["a"]
    tokens: dict[str, list[int]] = {}
    while a.status != RequestStatus.RUNNING:
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
    assert connector.held_loads() == 0  # dropped at admission
    assert a.num_cached_tokens == _loadable(len(prompt)) and a.cache.num_disk_cached_tokens == 0
    engine.abort_request("running")
    tokens.update(_run_to_end(engine))
    assert tokens["a"] == expected
    engine.check_no_leaks()
    engine.close()


def test_a_tenant_whose_head_waits_for_its_read_takes_no_running_slot_meanwhile(
    default_model_exact, tmp_path
):
    """Fair scheduling and overlapped loads: tenant a's request waits for its read while tenant
    r holds both running slots. Its turn preempts one of r's requests once; while the read is
    held, no further slot is taken from r (a preemption each step would only recompute r's
    request again and again), and a runs with the read's bytes once it is done."""
    model = default_model_exact
    expected = _stored(model, tmp_path)
    llm = _llm(model, tmp_path, scheduling_policy="fair", max_num_seqs=2)
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    gate = threading.Event()
    disk = connector._tiers[0]
    read_run = disk.read_run
    disk.read_run = lambda blocks, group: gate.wait(30) and read_run(blocks, group)
    for name in ("r1", "r2"):
        engine.add_request(name, _ids(llm, OTHER), LONG, tenant="r")
    engine.step()
    engine.add_request("a", _ids(llm, PROMPT), GREEDY, tenant="a")
    for _ in range(4):  # the read is held: a waits
        engine.step()
    assert connector._loads.held("a")
    assert engine.scheduler.requests["a"].status == RequestStatus.WAITING
    assert engine.scheduler.stats.num_preemptions <= 1
    gate.set()
    tokens = _run_to_end(engine)
    assert tokens["a"] == expected
    engine.check_no_leaks()
    engine.close()
