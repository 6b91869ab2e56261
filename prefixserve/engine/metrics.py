"""The engine's counters and current state as one flat dict (`LLMEngine.get_metrics`, the
server's /metrics), and how replicas' dicts combine into one (`combine_metrics`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.kv_store.connector import KVStoreConnector
from prefixserve.spec_decode.metrics import acceptance


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


# How each metric combines over replicas. Counters (every key not named here) are summed; these
# are state: summed where the replicas' parts add up, averaged where each is a fraction of its
# own pool, the largest where every replica reports one shared thing; rates are recomputed from
# the summed counters, never summed or averaged themselves.
SUMMED_GAUGES = frozenset({"num_kv_blocks", "num_free_kv_blocks", "num_running", "num_waiting"})
MEAN_GAUGES = frozenset({"kv_cache_usage"})
# One store directory that every replica on a host counts (replicas on several hosts each have
# their own: then the largest is a lower bound of the whole).
SHARED_GAUGES = frozenset({"kv_store_bytes"})
RATES = frozenset(
    {"prefix_cache_hit_rate", "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length"}
)


def combine_metrics(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Replicas' `engine_metrics` as one engine's: counters and summed gauges added, the pool
    usage averaged, a shared store's size taken once, rates recomputed from the sums."""
    total: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or key in RATES:
                continue
            if key in SHARED_GAUGES:
                total[key] = max(total.get(key, value), value)
            else:
                total[key] = total.get(key, 0) + value
    for key in MEAN_GAUGES & total.keys():
        total[key] /= len(parts)
    if parts:
        total.update(_rates(total))
    return total


def _rates(total: Mapping[str, Any]) -> dict[str, float]:
    queries = total.get("prefix_cache_queries", 0)
    rate, length = acceptance(
        total.get("spec_decode_num_drafts", 0),
        total.get("spec_decode_num_draft_tokens", 0),
        total.get("spec_decode_num_accepted_tokens", 0),
    )
    return {
        "prefix_cache_hit_rate": total.get("prefix_cache_hits", 0) / queries if queries else 0.0,
        "spec_decode_acceptance_rate": rate or 0.0,
        "spec_decode_mean_accepted_length": length or 0.0,
    }
