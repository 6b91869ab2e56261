"""An app's engine lives as long as the app, not as long as the process.

FastAPI keeps every endpoint callable it classifies in process-wide caches; a route that closed
over its engine kept that engine (its model, KV pool and caches) alive after its app was gone,
in every process that builds several apps (a host that embeds `build_app`, the test workers).
The routes find their state through the request instead (server/state.py `server_state`). The
engine here is real (the tiny random-weight Llama with the packaged tokenizer), served by uvicorn,
and every kind of route is called before the app is dropped.
"""

from __future__ import annotations

import gc
import weakref

import httpx

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.models import tiny_llama_dir
from tests.helpers.server import KEY_ADMIN, KEY_ALPHA, MODEL_NAME, serve_in_thread

# Every kind of route (the shell's, the operator routes' modules and both dialects'), with the
# status each answers here: /kv_events is off (404), no adapter is loaded to unload (404).
HI = [{"role": "user", "content": "Hi"}]
OPERATOR_CALLS = [
    ("GET", "/metrics", None, 200),
    ("GET", "/v1/cache/summary", None, 200),
    ("GET", "/pins", None, 200),
    ("GET", "/kv_events", None, 404),
    ("POST", "/reset_prefix_cache", None, 200),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "none-loaded"}, 404),
]
TENANT_CALLS = [
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}, 200),
    ("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": HI, "max_tokens": 2}, 200),
    ("POST", "/v1/messages", {"model": MODEL_NAME, "messages": HI, "max_tokens": 2}, 200),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": HI}, 200),
]


def _serve_once(tmp_path) -> weakref.ref:
    """Build an engine and its app, call every kind of route, stop both: a weak reference to
    the engine."""
    engine_config = EngineConfig(
        model=str(tiny_llama_dir(tmp_path / "model")),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=16, num_kv_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )
    engine = AsyncLLMEngine(LLMEngine(engine_config), log_stats_interval_s=None)
    engine.start()
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add_admin(KEY_ADMIN, "ops")
    app = build_app(engine, [MODEL_NAME], api_keys=keys)
    server, thread, url = serve_in_thread(app)
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.get("/health").status_code == 200
            for key, calls in ((KEY_ADMIN, OPERATOR_CALLS), (KEY_ALPHA, TENANT_CALLS)):
                for method, path, body, status in calls:
                    answer = http.request(
                        method, path, json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                    assert answer.status_code == status, (path, answer.text)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
    return weakref.ref(engine)


def test_a_stopped_apps_engine_is_freed_once_the_app_is_dropped(tmp_path):
    gone = _serve_once(tmp_path)
    gc.collect()
    if gone() is not None:
        holders = [type(r).__name__ for r in gc.get_referrers(gone())]
        raise AssertionError(f"the engine outlived its app; held by {holders}")
