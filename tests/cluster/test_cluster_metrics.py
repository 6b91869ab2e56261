"""Replicas' metrics combined as their kinds say: counters summed, rates recomputed from the
summed counters (never a sum of rates), the pool usage averaged, a shared store counted once; and
every metric an engine reports has a kind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.metrics import (
    MEAN_GAUGES,
    RATES,
    SHARED_GAUGES,
    SHARED_NAMES,
    SUMMED_GAUGES,
    combine_metrics,
)
from tests.helpers.cluster import FakeReplica, Remote, cluster_of

REPLICA_0 = {
    "prefix_cache_queries": 100,
    "prefix_cache_hits": 90,
    "prefix_cache_hit_rate": 0.9,
    "spec_decode_num_drafts": 10,
    "spec_decode_num_draft_tokens": 40,
    "spec_decode_num_accepted_tokens": 30,
    "spec_decode_acceptance_rate": 0.75,
    "spec_decode_mean_accepted_length": 4.0,
    "kv_cache_usage": 0.5,
    "num_kv_blocks": 100,
    "num_running": 2,
    "kv_store_bytes": 4096,
    "generation_tokens": 7,
}
REPLICA_1 = {
    **REPLICA_0,
    "prefix_cache_queries": 300,
    "prefix_cache_hits": 30,
    "prefix_cache_hit_rate": 0.1,
    "spec_decode_num_drafts": 0,
    "spec_decode_num_draft_tokens": 0,
    "spec_decode_num_accepted_tokens": 0,
    "spec_decode_acceptance_rate": 0.0,
    "spec_decode_mean_accepted_length": 0.0,
    "kv_cache_usage": 0.25,
    "kv_store_bytes": 8192,  # counted later than replica 0's: the same store, grown
}


def test_rates_are_recomputed_from_the_summed_counters_not_summed():
    total = combine_metrics([REPLICA_0, REPLICA_1])
    assert total["prefix_cache_hit_rate"] == pytest.approx(120 / 400)
    assert total["spec_decode_acceptance_rate"] == pytest.approx(30 / 40)
    assert total["spec_decode_mean_accepted_length"] == pytest.approx(1 + 30 / 10)
    assert total["kv_cache_usage"] == pytest.approx(0.375)
    assert total["kv_store_bytes"] == 8192
    assert (total["num_kv_blocks"], total["num_running"], total["generation_tokens"]) == (
        200,
        4,
        14,
    )


def test_the_cluster_engine_reports_rates_of_its_replicas_combined(monkeypatch):
    replicas = [FakeReplica(i, 0, dying=False, num_outputs=1) for i in range(2)]

    async def answer(metrics: dict[str, Any]) -> dict[str, Any]:
        return metrics

    for replica, metrics in zip(replicas, (REPLICA_0, REPLICA_1), strict=True):
        replica.metrics = Remote(lambda m=metrics: answer(m))
    engine = cluster_of(monkeypatch, *replicas)
    total = asyncio.run(engine.get_metrics())
    assert total["prefix_cache_hit_rate"] == pytest.approx(0.3)  # was 1.0: 0.9 + 0.1
    assert total["spec_decode_acceptance_rate"] == pytest.approx(0.75)
    assert total["replicas"] == {0: REPLICA_0, 1: REPLICA_1}


def test_every_metric_an_engine_reports_has_a_kind(default_model_fp32, tmp_path):
    from prefixserve.kv_store import KVStoreConfig

    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            cache=CacheConfig(num_kv_blocks=32),
            kv_store=KVStoreConfig(dir=tmp_path, capacity_bytes=1 << 20),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ),
        loaded_model=default_model_fp32,
    )
    kinds = SUMMED_GAUGES | MEAN_GAUGES | SHARED_GAUGES | SHARED_NAMES | RATES
    counters = {key for key in engine.get_metrics() if key not in kinds}
    # Every other key is a counter since the engine started: it only grows, so summing is right.
    assert all(
        key.startswith(
            (
                "prefix_cache_",
                "kv_store_",
                "spec_decode_num_",
                "num_",
                "cache_miss_",
                "structured_output_",
            )
        )
        or key.endswith("_tokens")
        for key in counters
    ), counters
    assert not any(key.endswith(("_rate", "_usage", "_length")) for key in counters), counters
    engine.close()
