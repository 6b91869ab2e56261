"""The engine's counters and current state as one flat dict (`LLMEngine.get_metrics`, the
server's /metrics)."""

from __future__ import annotations

from typing import Any, Protocol

from prefixserve.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.kv_store.connector import KVStoreConnector
from prefixserve.scheduler import Scheduler


class MetricsSource(Protocol):
    """What the metrics read of an `LLMEngine`."""

    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    num_kv_blocks: int
    kv_store: KVStoreConnector | None


def engine_metrics(engine: MetricsSource) -> dict[str, Any]:
    """Counters since the engine started, plus the current pool and queue state."""
    cache = engine.kv_cache_manager.make_prefix_cache_stats()
    sched = engine.scheduler.stats
    return {
        # Fresh admissions only (vLLM's prefix_cache_* counters); re-admissions after a
        # preemption are counted apart.
        "prefix_cache_requests": cache.requests,
        "prefix_cache_queries": cache.queries,
        "prefix_cache_hits": cache.hits,
        "prefix_cache_hit_rate": cache.hit_rate,
        "prefix_cache_preempted_requests": cache.preempted_requests,
        "prefix_cache_preempted_queries": cache.preempted_queries,
        "prefix_cache_preempted_hits": cache.preempted_hits,
        "kv_cache_usage": engine.kv_cache_manager.usage,
        "num_kv_blocks": engine.num_kv_blocks,
        "num_free_kv_blocks": engine.kv_cache_manager.num_free_blocks,
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "prompt_tokens": sched.num_prompt_tokens,
        "computed_prompt_tokens": sched.num_computed_prompt_tokens,
        "generation_tokens": sched.num_generation_tokens,
        "num_preemptions": sched.num_preemptions,
        "num_finished_requests": sched.num_finished_requests,
        "spec_decode_num_drafts": sched.spec_decode_num_drafts,
        "spec_decode_num_draft_tokens": sched.spec_decode_num_draft_tokens,
        "spec_decode_num_accepted_tokens": sched.spec_decode_num_accepted_tokens,
        **sched.spec_decode_rates(),
        **(engine.kv_store.metrics() if engine.kv_store is not None else {}),
    }
