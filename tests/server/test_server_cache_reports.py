"""Cache reports over HTTP (issue 29): every reason of the vocabulary produced through the server,
in the response and in the last stream chunk; tenants cannot tell another tenant's prefix from a
never-seen one (report and metrics labels); the summary and the miss counters are an operator's
only. A tiny random-weight Llama with two adapters, a disk tier and chunked prefill serves the
token-id prompts; chat runs on the session's default model."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.bench.lora_adapters import write_random_adapter
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from prefixserve.core.kv_cache.reports.report import REASONS
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.kv_store import KVStoreConfig
from prefixserve.model.loader.loading import LoadedModel
from tests.helpers import random_tokens
from tests.helpers.models import VOCAB, build_hf_model, build_ours
from tests.helpers.server import (
    KEY_ADMIN,
    KEY_ALPHA,
    KEY_BETA,
    MODEL_NAME,
    LiveServer,
    serve_in_thread,
    ssl_context,
)

BLOCK = 16


@pytest.fixture(scope="module")
def live(tmp_path_factory, default_model_fp32):
    root = tmp_path_factory.mktemp("reports-server")
    hf, config_json = build_hf_model("llama", root / "model")
    model, config = build_ours(hf, config_json)
    loaded = LoadedModel(
        model=model, tokenizer=default_model_fp32.tokenizer, config=config, path=root / "model"
    )
    modules = {
        name: str(write_random_adapter(root / name, config, rank=4, seed=i + 1))
        for i, name in enumerate(("a1", "a2"))
    }
    engine_config = EngineConfig(
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=8, long_prefill_token_threshold=8),
        kv_store=KVStoreConfig(dir=root / "store", capacity_bytes=1 << 28),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
    )
    engine = LLMEngine(engine_config, loaded_model=loaded)
    for name, path in modules.items():
        engine.load_lora_adapter(name, path)
    async_engine = AsyncLLMEngine(engine, log_stats_interval_s=None)
    async_engine.start()
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add(KEY_BETA, "beta")
    keys.add_admin(KEY_ADMIN, "ops")
    app = build_app(async_engine, [MODEL_NAME], api_keys=keys, lora_modules=modules)
    server, thread, url = serve_in_thread(app)
    yield LiveServer(url=url, api_key=KEY_ALPHA, engine=async_engine)
    server.should_exit = True
    thread.join(timeout=30)
    async_engine.shutdown()
    engine.close()


_seed = iter(range(1000, 10**6))


def prompt(num_tokens: int) -> list[int]:
    return [t % VOCAB for t in random_tokens(num_tokens, seed=next(_seed))]


def complete(live: LiveServer, ids: list[int], key: str = KEY_ALPHA, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0, **extra}
    with live.http(key) as http:
        response = http.post("/v1/completions", json={"cache_report": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def reason(live: LiveServer, ids: list[int], **extra) -> str:
    return complete(live, ids, **extra)["cache_report"]["reason"]


def flush_disk(live: LiveServer) -> None:
    live.run_in_engine(lambda e: e.kv_connector.writer.flush(timeout=30))


def reset_ram(live: LiveServer) -> None:
    with live.http(KEY_ADMIN) as http:
        assert http.post("/reset_prefix_cache", params={"ram_only": "true"}).status_code == 200


def test_the_report_is_there_only_when_asked_for(live):
    ids = prompt(2 * BLOCK + 3)
    with live.http() as http:
        plain = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids}).json()
    assert "cache_report" not in plain
    report = complete(live, ids)["cache_report"]
    assert report["reason"] == "not_full_block"
    assert report["tokens"] == {"ram": 2 * BLOCK, "disk": 0, "computed": 3}
    assert report["hit_blocks"] == report["prompt_full_blocks"] == 2


def test_never_seen_last_token_rule_and_salt(live):
    ids = prompt(3 * BLOCK)
    assert reason(live, ids, cache_salt="one") == "never_seen"
    assert reason(live, ids, cache_salt="one") == "last_token_rule"
    assert reason(live, ids, cache_salt="two") == "salt_or_tenant"


def test_another_tenants_prefix_reads_as_never_seen_in_report_and_metrics(live):
    ids = prompt(3 * BLOCK + 1)
    complete(live, ids)  # alpha computes it
    before = miss_counts(live)
    seen_elsewhere = complete(live, ids, key=KEY_BETA)["cache_report"]
    never = complete(live, prompt(3 * BLOCK + 1), key=KEY_BETA)["cache_report"]
    assert seen_elsewhere == never and never["reason"] == "never_seen"
    after = miss_counts(live)
    assert after["never_seen"] == before["never_seen"] + 2
    assert {r: after[r] - before[r] for r in REASONS if r != "never_seen"} == dict.fromkeys(
        set(REASONS) - {"never_seen"}, 0
    )


def test_cache_disabled_when_prompt_logprobs_need_every_position(live):
    ids = prompt(2 * BLOCK + 1)
    complete(live, ids)
    assert reason(live, ids, prompt_logprobs=1) == "cache_disabled"


def test_evicted_after_an_operator_reset(live):
    ids = prompt(2 * BLOCK + 1)
    complete(live, ids, prompt_cache_retention="in_memory")  # never reaches the disk tier
    reset_ram(live)
    report = complete(live, ids, prompt_cache_retention="in_memory")["cache_report"]
    assert report["reason"] == "evicted" and report["detail"]["policy"] == "reset"
    assert report["detail"]["retention"] == "in_memory"


def test_adapter(live):
    ids = prompt(2 * BLOCK + 1)
    complete(live, ids, model="a1")
    assert reason(live, ids, model="a2") == "adapter"


def test_disk_load_skipped_and_expired(live):
    ids = prompt(3 * BLOCK + 1)
    complete(live, ids)
    flush_disk(live)
    reset_ram(live)

    def slow_disk(engine: LLMEngine) -> tuple:
        speeds = engine.kv_connector._speeds
        before = (speeds.load_s_per_block, speeds.compute_s_per_token)
        speeds.load_s_per_block, speeds.compute_s_per_token = {"disk": 1.0}, 1e-6
        return before

    before = live.run_in_engine(slow_disk)
    try:
        assert reason(live, ids) == "disk_load_skipped"
    finally:
        live.run_in_engine(
            lambda e: setattr(e.kv_connector, "_speeds", type(e.kv_connector._speeds)(*before))
        )
    ids = prompt(3 * BLOCK + 1)
    complete(live, ids)
    flush_disk(live)
    store = Path(live.run_in_engine(lambda e: str(e.kv_connector.store.root)))
    past = time.time() - 10
    for path in store.rglob("*.kv"):  # a record's mtime is its expiry
        os.utime(path, (past, past))
    reset_ram(live)
    assert reason(live, ids) == "expired"


def test_in_flight_wait_and_the_last_stream_chunk(live):
    """Two requests for one long prompt at once: the second waits for the first's chunked
    prefill (8 tokens a step), then hits. The step thread is held while both arrive, so both
    are added before the next step; arrival is still up to the network: tried three times."""

    async def both(ids: list[int]) -> list:
        gate = threading.Event()
        holder = threading.Thread(target=live.run_in_engine, args=(lambda e: gate.wait(30),))
        holder.start()
        try:
            async with httpx.AsyncClient(
                base_url=live.url,
                headers={"Authorization": f"Bearer {KEY_ALPHA}"},
                verify=ssl_context(),
                timeout=120,
            ) as http:
                body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "cache_report": True}
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.2)
                second = asyncio.create_task(
                    http.post("/v1/completions", json={**body, "stream": True})
                )
                await asyncio.sleep(0.3)
                gate.set()
                return [(await first).json(), await second]
        finally:
            gate.set()
            holder.join()

    for _ in range(3):
        first, stream = asyncio.run(both(prompt(15 * BLOCK + 1)))
        chunks = [
            json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")
        ]
        last = chunks[-1]
        assert last["choices"] == [] and "cache_report" in last
        assert all("cache_report" not in c for c in chunks[:-1])
        if last["cache_report"]["reason"] == "in_flight_wait":
            assert first["cache_report"]["reason"] == "never_seen"
            assert last["cache_report"]["hit_blocks"] >= 14
            return
    pytest.fail(f"the second request never waited: {last['cache_report']}")


def miss_counts(live: LiveServer) -> dict[str, float]:
    with live.http(KEY_ADMIN) as http:
        text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "prefixserve_cache_miss_reasons":
            return {
                s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")
            }
    raise AssertionError("no prefixserve_cache_miss_reasons_total in /metrics")


def test_summary_and_metrics_are_an_operators_only(live):
    complete(live, prompt(4 * BLOCK + 1))
    for key in (KEY_ALPHA, KEY_BETA):
        with live.http(key) as http:
            for path in ("/v1/cache/summary", "/inspector", "/inspector/events", "/metrics"):
                assert http.get(path).status_code == 403, path
    with live.http(KEY_ADMIN) as http:
        summary = http.get("/v1/cache/summary").json()
        with_text = http.get("/v1/cache/summary", params={"text": "true"}).json()
    assert set(summary["miss_reasons"]) == set(REASONS)
    assert summary["pool"]["cached"] > 0 and summary["tiers"]["disk"] is not None
    assert {row["tenant"] for row in summary["pool"]["by_tenant"]} >= {"alpha"}
    assert summary["recent_reports"][0]["report"]["reason"] in REASONS
    assert summary["tree"]["children"] and summary["top_prefixes"]
    assert "text" not in json.dumps(summary["top_prefixes"])
    assert all("text" in node for node in with_text["top_prefixes"])
    assert sum(row["blocks"] for row in summary["pool"]["by_tenant"]) == summary["pool"]["cached"]


def test_the_inspector_takes_the_operator_key_as_basic_auth(live):
    with httpx.Client(base_url=live.url, verify=ssl_context()) as http:
        missing = http.get("/inspector")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Basic realm=")
        assert http.get("/inspector", auth=("ops", KEY_ADMIN)).status_code == 200
        assert http.get("/inspector", auth=("me", KEY_ALPHA)).status_code == 403
        assert http.get("/inspector/static/../app.py", auth=("ops", KEY_ADMIN)).status_code == 404
        assert http.get("/inspector/static/nope.js", auth=("ops", KEY_ADMIN)).status_code == 404
        # Basic is for the read-only inspector GETs only: never for a route that changes state.
        refused = http.post("/reset_prefix_cache", auth=("ops", KEY_ADMIN))
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/cache/summary", auth=("ops", KEY_ADMIN)).status_code == 401
        page = http.get("/inspector", auth=("ops", KEY_ADMIN))
        assert "default-src 'self'" in page.headers["content-security-policy"]


def test_chat_returns_the_report_on_the_default_model(server):
    with server.http() as http:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "cache report chat " * 20}],
            "max_tokens": 2,
            "cache_report": True,
        }
        first = http.post("/v1/chat/completions", json=body).json()["cache_report"]
        second = http.post("/v1/chat/completions", json=body).json()["cache_report"]
    assert first["reason"] in REASONS and second["hit_blocks"] >= first["prompt_full_blocks"] - 1


def test_without_keys_prefix_text_is_refused(open_server):
    with open_server.http() as http:
        assert http.get("/v1/cache/summary").status_code == 200
        refused = http.get("/v1/cache/summary", params={"text": "true"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "text_needs_operator_key"
        assert http.get("/inspector/events", params={"text": "true"}).status_code == 403


def test_event_streams_are_bounded_and_given_back(live):
    """MAX_EVENT_STREAMS at once, a 429 past them, and every place back once they close."""
    from prefixserve.entrypoints.server.serving_cache import MAX_EVENT_STREAMS

    def open_stream(http: httpx.Client):
        response = http.send(http.build_request("GET", "/inspector/events"), stream=True)
        return response

    with httpx.Client(
        base_url=live.url, auth=("ops", KEY_ADMIN), verify=ssl_context(), timeout=30
    ) as http:
        for _ in range(2):  # twice: the places given back are all there again
            streams = [open_stream(http) for _ in range(MAX_EVENT_STREAMS)]
            try:
                assert all(s.status_code == 200 for s in streams)
                # Each has started: its first line arrived (the iterators are kept: a line
                # iterator that is dropped closes its response).
                lines = [s.iter_lines() for s in streams]
                assert all(next(it).startswith("retry:") for it in lines)
                extra = open_stream(http)
                extra.close()
                assert extra.status_code == 429
                # A capacity refusal, as every other 429 of the server: when to come back.
                assert int(extra.headers["Retry-After"]) >= 1
            finally:
                for s in streams:
                    s.close()
            deadline = time.monotonic() + 30
            while True:  # the server sees the disconnects within an interval or two
                probe = open_stream(http)
                status = probe.status_code
                probe.close()
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert status == 200


def test_a_summary_build_counts_its_own_time_not_the_wait_for_a_long_step(live):
    """The feed spaces rebuilds by the build's own time; a build queued behind a long step must
    not count that wait, or the inspector freezes for 20x that step after one long prompt. The
    step thread is held until the feed's build is queued behind it: the build time the feed
    records must fit in what the call took after the release (counting the wait, it would not)."""
    from prefixserve.entrypoints.server.summary_feed import BUSY_SHARE_DIVISOR, SummaryFeed

    engine = live.engine
    feed = SummaryFeed(engine)
    holding, release = threading.Event(), threading.Event()

    def long_step(_engine: LLMEngine) -> None:
        holding.set()
        assert release.wait(timeout=120), "the test never released the step thread"

    async def build_behind_a_long_step() -> tuple[float, float]:
        hold = asyncio.ensure_future(engine.run_in_engine(long_step))
        assert await asyncio.to_thread(holding.wait, 120), "the step thread never ran the hold"
        build = asyncio.ensure_future(feed.get(False))
        await asyncio.sleep(0.5)  # the build is queued behind the held step thread
        assert not build.done()
        released = time.perf_counter()
        release.set()
        await build
        done = time.perf_counter()
        await hold
        return released, done

    released, done = asyncio.run(build_behind_a_long_step())
    assert 0.0 < feed.build_s <= done - released
    assert feed.current_interval_s <= max(feed.interval_s, BUSY_SHARE_DIVISOR * (done - released))
