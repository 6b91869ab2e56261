"""How replicas' metrics combine into one engine's (`combine_metrics`): the kind of every metric
`LLMEngine.get_metrics` reports (counter, summed or averaged gauge, shared gauge, rate)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixserve.core.sched.spec_metrics import acceptance

# How each metric combines over replicas. Counters (every key not named here) are summed; these
# are state: summed where the replicas' parts add up, averaged where each is a fraction of its
# own pool, the largest where every replica reports one shared thing; rates are recomputed from
# the summed counters, never summed or averaged themselves.
SUMMED_GAUGES = frozenset(
    {
        "num_kv_blocks",
        "num_free_kv_blocks",
        "num_running",
        "num_waiting",
        "structured_output_cached_grammars",
        "kv_cache_cached_blocks",
        "kv_cache_pinned_blocks",
        "kv_cache_breakpoint_blocks",
        "kv_cache_breakpoints",
        "cache_ghost_entries",
    }
)
MEAN_GAUGES = frozenset({"kv_cache_usage"})
# One store directory that every replica on a host counts (replicas on several hosts each have
# their own: then the largest is a lower bound of the whole).
SHARED_GAUGES = frozenset({"kv_store_bytes", "kv_cache_bytes_per_token"})
# Names every replica reports alike (one engine configuration): kept when all agree.
SHARED_NAMES = frozenset({"kv_cache_dtype"})
RATES = frozenset(
    {"prefix_cache_hit_rate", "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length"}
)


def combine_metrics(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Replicas' `LLMEngine.get_metrics` as one engine's: counters and summed gauges added, the pool
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
    for key in SHARED_NAMES:
        names = {part.get(key) for part in parts}
        if len(names) == 1 and None not in names:
            total[key] = names.pop()
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
