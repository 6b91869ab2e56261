"""Cache reports through the engine: every reason of the vocabulary produced by a real request
on a tiny random-weight Llama, the ghost table's bound, the metrics by reason, the dry-run
`explain_prompt`, and that a tenant cannot tell another tenant's prefix from a never-seen one
(issue 29)."""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from prefixserve.bench.lora_adapters import write_random_adapter
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from prefixserve.core.kv_cache.reports.ghost import EvictionGhosts
from prefixserve.core.kv_cache.reports.report import REASONS
from prefixserve.core.kv_cache.salts import derive_cache_salt
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.kv_store import KVStoreConfig
from prefixserve.llm import LLM
from prefixserve.lora.config import LoRARequest
from prefixserve.model.loader.loading import LoadedModel
from prefixserve.sampling_params import SamplingParams
from tests.helpers import random_tokens
from tests.helpers.models import VOCAB, build_hf_model, build_ours

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_fp32):
    root = tmp_path_factory.mktemp("reports")
    hf, config_json = build_hf_model("llama", root / "model")
    model, config = build_ours(hf, config_json)
    loaded = LoadedModel(
        model=model, tokenizer=default_model_fp32.tokenizer, config=config, path=root / "model"
    )
    adapters = {
        name: str(write_random_adapter(root / name, config, rank=4, seed=i + 1))
        for i, name in enumerate(("a1", "a2"))
    }
    return loaded, adapters


def make_engine(tiny, tmp_path: Path | None = None, **cache) -> LLMEngine:
    loaded, _ = tiny
    lora = cache.pop("lora", None)
    threshold = cache.pop("long_prefill_token_threshold", 0)
    config = EngineConfig(
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=BLOCK, **{"num_kv_blocks": 64, **cache}),
        scheduler=SchedulerConfig(max_num_seqs=8, long_prefill_token_threshold=threshold),
        kv_store=None if tmp_path is None else KVStoreConfig(dir=tmp_path, capacity_bytes=1 << 28),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8) if lora else None,
    )
    return LLMEngine(config, loaded_model=loaded)


def tokens(n: int, seed: int) -> list[int]:
    return [t % VOCAB for t in random_tokens(n, seed=seed)]


def run(engine: LLMEngine, request_id: str, prompt: list[int], **options) -> dict:
    """Run one request alone to the end; its final output's cache report."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_report=True)
    engine.add_request(request_id, prompt, params, **options)
    report = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                report = out.cache_report
    assert report is not None
    return report


def test_never_seen_then_not_full_block(tiny):
    engine = make_engine(tiny)
    prompt = tokens(3 * BLOCK + 5, seed=1)
    first = run(engine, "a", prompt)
    assert first["reason"] == "never_seen"
    assert (first["hit_blocks"], first["first_miss_block"]) == (0, 0)
    assert first["tokens"] == {"ram": 0, "disk": 0, "computed": 3 * BLOCK + 5}
    second = run(engine, "b", prompt)
    assert second["reason"] == "not_full_block"
    assert second["hit_blocks"] == second["prompt_full_blocks"] == 3
    assert second["tokens"] == {"ram": 3 * BLOCK, "disk": 0, "computed": 5}
    engine.check_no_leaks()


def test_last_token_rule(tiny):
    engine = make_engine(tiny)
    prompt = tokens(3 * BLOCK, seed=2)
    run(engine, "a", prompt)
    report = run(engine, "b", prompt)
    assert report["reason"] == "last_token_rule" and report["detail"] == {"cached": True}
    assert (report["hit_blocks"], report["first_miss_block"]) == (2, 2)


def test_cache_disabled_when_caching_is_off_or_skipped(tiny):
    engine = make_engine(tiny, enable_prefix_caching=False)
    report = run(engine, "a", tokens(40, seed=3))
    assert report["reason"] == "cache_disabled" and report["first_miss_block"] is None
    engine = make_engine(tiny)
    prompt = tokens(40, seed=3)
    run(engine, "a", prompt)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, cache_report=True)
    engine.add_request("b", prompt, params)
    finals = [o for _ in range(20) for o in engine.step() if o.finished]
    assert finals[0].cache_report["reason"] == "cache_disabled"


def test_evicted_names_the_policy_and_how_long_ago(tiny):
    engine = make_engine(tiny, num_kv_blocks=12, eviction_policy="slru")
    prompt = tokens(4 * BLOCK + 3, seed=4)
    run(engine, "a", prompt, cache_retention="in_memory")
    for i in range(3):  # 11 blocks of other prompts push the first one out
        run(engine, f"filler-{i}", tokens(4 * BLOCK + 3, seed=100 + i))
    report = run(engine, "again", prompt, cache_retention="in_memory")
    assert report["reason"] == "evicted"
    assert report["detail"]["policy"] == "slru"
    assert 0 <= report["detail"]["ago_s"] < 60
    assert report["detail"]["retention"] == "in_memory"
    engine.check_no_leaks()


def test_a_reset_reads_as_evicted_by_reset(tiny):
    engine = make_engine(tiny)
    prompt = tokens(2 * BLOCK + 1, seed=5)
    run(engine, "a", prompt)
    assert engine.reset_prefix_cache()
    report = run(engine, "b", prompt)
    assert report["reason"] == "evicted" and report["detail"]["policy"] == "reset"


def test_the_ghost_table_is_bounded():
    ghosts = EvictionGhosts(4)
    ghosts.add([bytes([i]) * 32 for i in range(10)], when=1.0, cause="lru")
    assert len(ghosts) == 4
    assert ghosts.get(bytes([9]) * 32) == (1.0, "lru") and ghosts.get(bytes([0]) * 32) is None
    assert ghosts.bytes_bound() == 4 * EvictionGhosts(1).bytes_bound() > 4 * 32
    assert EvictionGhosts(0).bytes_bound() == 0
    with pytest.raises(ValueError, match="capacity"):
        EvictionGhosts(-1)


def test_a_ghost_table_of_zero_says_never_seen(tiny):
    engine = make_engine(tiny, cache_ghost_entries=0)
    prompt = tokens(2 * BLOCK + 1, seed=6)
    run(engine, "a", prompt)
    assert engine.reset_prefix_cache()
    assert run(engine, "b", prompt)["reason"] == "never_seen"


def test_salt_or_tenant_within_a_tenant_and_never_seen_across_tenants(tiny):
    engine = make_engine(tiny)
    prompt = tokens(3 * BLOCK + 1, seed=7)
    alpha_1 = derive_cache_salt("alpha", "one")
    run(engine, "a", prompt, cache_salt=alpha_1, tenant="alpha")
    report = run(engine, "b", prompt, cache_salt=derive_cache_salt("alpha", "two"), tenant="alpha")
    assert report["reason"] == "salt_or_tenant" and report["first_miss_block"] == 0


def test_another_tenants_prefix_is_indistinguishable_from_a_never_seen_one(tiny):
    """Same report, same probes made (the report path does the same work, so its timing
    cannot tell), same metric label."""
    engine = make_engine(tiny)
    prompt = tokens(3 * BLOCK + 1, seed=8)
    run(engine, "alpha-1", prompt, cache_salt=derive_cache_salt("alpha", None), tenant="alpha")
    run(engine, "alpha-2", prompt, cache_salt=derive_cache_salt("alpha", "x"), tenant="alpha")
    # beta has used two namespaces too, so both of its reports check one other namespace.
    beta = {"cache_salt": derive_cache_salt("beta", None), "tenant": "beta"}
    run(
        engine,
        "beta-0",
        tokens(40, seed=9),
        cache_salt=derive_cache_salt("beta", "y"),
        tenant="beta",
    )
    probes, counts = engine.explainer.num_probes, dict(engine.explainer.counts)
    seen_elsewhere = run(engine, "beta-1", prompt, **beta)
    probes_seen = engine.explainer.num_probes - probes
    after_seen = dict(engine.explainer.counts)
    never = run(engine, "beta-2", tokens(3 * BLOCK + 1, seed=10), **beta)
    probes_never = engine.explainer.num_probes - probes - probes_seen
    assert seen_elsewhere == never
    assert seen_elsewhere["reason"] == "never_seen"
    assert probes_seen == probes_never > 0
    assert after_seen["never_seen"] == counts["never_seen"] + 1
    assert engine.explainer.counts["never_seen"] == counts["never_seen"] + 2


def test_adapter_when_the_prefix_is_cached_under_another_adapter(tiny):
    engine = make_engine(tiny, lora=True)
    _, adapters = tiny
    prompt = tokens(2 * BLOCK + 1, seed=11)
    run(engine, "a", prompt, lora_request=LoRARequest("a1", 1, adapters["a1"]))
    report = run(engine, "b", prompt, lora_request=LoRARequest("a2", 2, adapters["a2"]))
    assert report["reason"] == "adapter"
    assert run(engine, "c", prompt)["reason"] == "adapter"  # the base model is a namespace too


def test_disk_load_skipped_when_loading_is_measured_slower(tiny, tmp_path):
    engine = make_engine(tiny, tmp_path)
    prompt = tokens(3 * BLOCK + 1, seed=12)
    run(engine, "a", prompt)
    engine.kv_connector.writer.flush(timeout=30)
    assert engine.reset_prefix_cache(ram_only=True)
    assert run(engine, "b", prompt)["tokens"]["disk"] == 3 * BLOCK  # loading pays: loaded
    assert engine.reset_prefix_cache(ram_only=True)
    speeds = engine.kv_connector._speeds
    speeds.load_s_per_block, speeds.compute_s_per_token = {"disk": 1.0}, 1e-6
    report = run(engine, "c", prompt)
    assert report["reason"] == "disk_load_skipped" and report["tokens"]["disk"] == 0
    engine.close()


def test_expired_when_the_disk_copy_is_past_its_retention(tiny, tmp_path):
    engine = make_engine(tiny, tmp_path)
    prompt = tokens(3 * BLOCK + 1, seed=13)
    run(engine, "a", prompt)
    engine.kv_connector.writer.flush(timeout=30)
    past = time.time() - 10
    for path in Path(tmp_path).rglob("*.kv"):  # a record's mtime is its expiry
        os.utime(path, (past, past))
    assert engine.reset_prefix_cache(ram_only=True)
    report = run(engine, "b", prompt)
    assert report["reason"] == "expired" and report["tokens"]["disk"] == 0
    engine.close()


def test_in_flight_wait_when_another_request_was_computing_the_prefix(tiny):
    engine = make_engine(tiny, long_prefill_token_threshold=BLOCK)
    prompt = tokens(6 * BLOCK + 1, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=1, cache_report=True)
    engine.add_request("first", prompt, params)
    engine.step()  # one chunk of the first is computed; the rest is in flight
    engine.add_request("second", prompt, params)
    reports = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reports[out.request_id] = out.cache_report
    assert reports["second"]["reason"] == "in_flight_wait"
    assert reports["second"]["hit_blocks"] >= 5
    assert reports["first"]["reason"] == "never_seen"


def test_every_request_counts_one_reason_in_the_metrics(tiny):
    engine = make_engine(tiny)
    prompt = tokens(2 * BLOCK + 3, seed=15)
    params = SamplingParams(max_tokens=1)  # no report asked for: counted all the same
    for i in range(3):
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            assert all(o.cache_report is None for o in engine.step())
    metrics = engine.get_metrics()
    counts = {reason: metrics[f"cache_miss_{reason}"] for reason in REASONS}
    assert counts["never_seen"] == 1 and counts["not_full_block"] == 2
    assert sum(counts.values()) == 3
    assert metrics["kv_cache_cached_blocks"] == 2 and metrics["cache_ghost_entries"] == 0


def test_explain_prompt_is_a_dry_run_that_says_where_the_prompt_parts(tiny):
    engine = make_engine(tiny)
    cached = tokens(4 * BLOCK + 1, seed=16)
    run(engine, "a", cached)
    before = (dict(engine.explainer.counts), engine.get_metrics()["prefix_cache_queries"])
    changed = list(cached)
    changed[2 * BLOCK + 5] = (changed[2 * BLOCK + 5] + 1) % VOCAB
    report = engine.explain_prompt(changed)
    assert report.hit_blocks == 2 and report.reason == "never_seen"
    assert report.detail["differs_at_token"] == 2 * BLOCK + 5
    assert engine.explain_prompt(cached).reason == "not_full_block"
    assert (dict(engine.explainer.counts), engine.get_metrics()["prefix_cache_queries"]) == before
    engine.check_no_leaks()


def test_the_offline_api_reports_and_explains(tiny):
    loaded, _ = tiny
    llm = LLM(loaded_model=loaded, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    prompt = tokens(4 * BLOCK + 1, seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=1, cache_report=True)
    (cold,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert cold.cache_report["reason"] == "never_seen"
    (plain,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1))
    assert plain.cache_report is None  # only when asked for
    changed = [*prompt[: BLOCK + 3], (prompt[BLOCK + 3] + 1) % VOCAB, *prompt[BLOCK + 4 :]]
    explained = llm.explain({"prompt_token_ids": changed})
    assert explained["hit_blocks"] == 1 and explained["reason"] == "never_seen"
    assert explained["detail"]["differs_at_token"] == BLOCK + 3
    assert explained["summary"] == (
        f"this prompt would hit {BLOCK} of {4 * BLOCK + 1} tokens; block 1 (tokens {BLOCK}-"
        f"{2 * BLOCK - 1}) misses: no cached prompt has it; it differs from the cached one at "
        f"token {BLOCK + 3}"
    )
    # Without tenants a salt keeps clients apart: another salt's prefix is never named.
    salted = llm.explain({"prompt_token_ids": prompt, "cache_salt": "mine"})
    assert salted["reason"] == "never_seen" and salted["hit_blocks"] == 0
    with pytest.raises(ValueError, match="cache_report"):
        SamplingParams(cache_report="yes")


def test_a_full_ghost_table_stays_within_its_bound():
    capacity = 4096
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        ghosts = EvictionGhosts(capacity)
        for batch in range(8):  # one tuple per batch, as the pool adds them
            hashes = [os.urandom(32) for _ in range(capacity // 4)]
            ghosts.add(hashes, when=float(batch), cause="lru")
            del hashes
        used = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert len(ghosts) == capacity
    assert used <= ghosts.bytes_bound()


def test_the_last_tokens_block_is_last_token_rule_cached_or_not(tiny):
    """It is never served either way; `detail.cached` says whether it was there."""
    engine = make_engine(tiny)
    prompt = tokens(3 * BLOCK, seed=18)
    run(engine, "a", prompt)
    other_end = prompt[: 2 * BLOCK] + tokens(BLOCK, seed=19)
    report = run(engine, "b", other_end)
    assert report["hit_blocks"] == 2 and report["reason"] == "last_token_rule"
    assert report["detail"] == {"cached": False}


def test_the_report_is_made_before_the_request_evicts_anything_itself(tiny):
    """A full pool: the repeat's one new block evicts the cached copy of its own last block,
    which the report (made before that allocation) still sees."""
    engine = make_engine(tiny, num_kv_blocks=4)
    prompt = tokens(3 * BLOCK, seed=20)
    run(engine, "a", prompt)
    report = run(engine, "b", prompt)
    assert report["reason"] == "last_token_rule" and report["detail"] == {"cached": True}
    engine.check_no_leaks()


def test_a_disk_read_that_fails_reads_as_evicted_from_the_disk_tier(tiny, tmp_path):
    engine = make_engine(tiny, tmp_path)
    prompt = tokens(3 * BLOCK + 1, seed=21)
    run(engine, "a", prompt)
    engine.kv_connector.writer.flush(timeout=30)
    assert engine.reset_prefix_cache(ram_only=True)
    # The stat says yes, the read says no.
    engine.kv_connector.store.get = lambda key, token_ids, parent=b"": None
    report = run(engine, "b", prompt)
    assert report["reason"] == "evicted" and report["detail"] == {"tier": "disk"}
    assert report["tokens"] == {"ram": 0, "disk": 0, "computed": 3 * BLOCK + 1}
    engine.close()


def test_a_prompts_samples_count_once(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=3, max_tokens=2, cache_report=True, seed=1)
    engine.add_request("n3", tokens(2 * BLOCK + 1, seed=22), params)
    finals = [o for _ in range(50) for o in engine.step() if o.finished]
    assert finals[0].cache_report["reason"] == "never_seen"
    assert sum(engine.explainer.counts.values()) == 1 and len(engine.explainer.recent) == 1


@pytest.mark.parametrize("bad", ["x", 3, [None, None]])
def test_explain_refuses_a_lora_request_that_is_not_one_as_generate_does(tiny, bad):
    loaded, _ = tiny
    llm = LLM(loaded_model=loaded, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    prompt = {"prompt_token_ids": tokens(2 * BLOCK, seed=3)}
    with pytest.raises(ValueError, match="lora_request must be None") as from_generate:
        llm.generate([prompt], SamplingParams(max_tokens=1), lora_request=bad)
    with pytest.raises(ValueError, match="lora_request must be None") as from_explain:
        llm.explain(prompt, lora_request=bad)
    assert str(from_explain.value) == str(from_generate.value)


def test_the_summary_tree_goes_at_most_max_tree_depth_levels_below_the_root():
    from prefixserve.core.kv_cache.reports.summary import MAX_TREE_DEPTH, prefix_tree
    from tests.helpers.kv_cache import make_manager, make_request, schedule

    mgr = make_manager(num_blocks=96)
    chain = list(range(1000, 1000 + 4 * 40))
    for level in range(1, 40):  # a branch at every level: each node is one block
        request = make_request(f"r{level}", chain[: 4 * level] + [5000 + level] * 4 + [7])
        assert schedule(mgr, request) is not None
        mgr.free(request)
    tree, _ = prefix_tree(mgr, mgr.recorder)

    def depth(node: dict) -> int:
        return 1 + max((depth(child) for child in node["children"]), default=0)

    assert depth(tree) - 1 == MAX_TREE_DEPTH  # levels below the root
