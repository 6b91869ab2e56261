"""Fixtures of the server tests: one engine on the default model, two live servers over it.

- `server`: API keys for two tenants (`alpha` with two keys, `beta` with one) and an operator key;
- `open_server`: no keys (the client's cache_salt passes through, as in vLLM).
Both share the engine, so its metrics and blocks are the same wherever a test looks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.server import (
    BLOCK_SIZE,
    KEY_ADMIN,
    KEY_ALPHA,
    KEY_ALPHA_2,
    KEY_BETA,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_KV_BLOCKS,
    LiveServer,
    serve_in_thread,
)


@pytest.fixture(scope="session")
def async_engine() -> Iterator[AsyncLLMEngine]:
    config = EngineConfig(
        model=None,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(
            block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, enable_kv_events=True
        ),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    engine = AsyncLLMEngine(LLMEngine(config), log_stats_interval_s=10.0, collect_kv_events=True)
    engine.start()
    yield engine
    engine.shutdown()


def _live(async_engine: AsyncLLMEngine, api_keys: ApiKeys | None, key: str | None):
    app = build_app(async_engine, [MODEL_NAME, "alias-model"], api_keys=api_keys)
    server, thread, url = serve_in_thread(app)
    yield LiveServer(url=url, api_key=key, engine=async_engine)
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="session")
def server(async_engine: AsyncLLMEngine) -> Iterator[LiveServer]:
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add(KEY_ALPHA_2, "alpha")
    keys.add(KEY_BETA, "beta")
    keys.add_admin(KEY_ADMIN, "ops")
    yield from _live(async_engine, keys, KEY_ALPHA)


@pytest.fixture(scope="session")
def open_server(async_engine: AsyncLLMEngine) -> Iterator[LiveServer]:
    yield from _live(async_engine, None, None)


@pytest.fixture(scope="session")
def tokenizer(async_engine: AsyncLLMEngine) -> Any:
    return async_engine.tokenizer


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()
