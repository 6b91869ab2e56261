"""The engine's cache-wide summary (`LLMEngine.cache_summary`): the pool, the tiers, pins, recent
hit and eviction rates, miss reasons, the ghost table, the prefix tree and recent reports.

Operators only (the server's `GET /v1/cache/summary` and the inspector page): it names tenants.
Prefix text is decoded only when asked for (`include_text`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prefixserve.core.kv_cache.reports.explain import RECENT_REPORTS
from prefixserve.core.kv_cache.reports.summary import (
    TOP_PREFIXES,
    pool_summary,
    prefix_tree,
    window_rates,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.kv_cache.reports.explain import CacheExplainer
    from prefixserve.kv_store.connector import KVStoreConnector


def build_cache_summary(
    manager: KVCacheManager,
    explainer: CacheExplainer,
    connector: KVStoreConnector | None,
    decode: Callable[[list[int]], str] | None = None,
    kv_cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """See the module docstring; the shape is docs/cache_reports.md's. `decode` (token ids ->
    text) adds each prefix's text; `kv_cache` is `LLMEngine.kv_cache_format()` (the KV dtype
    and bytes per token)."""
    recorder = manager.recorder
    tree, top = prefix_tree(manager, recorder, decode)
    window = window_rates(recorder)
    stats = manager.make_prefix_cache_stats()
    window["hit_rate"]["all"] = round(stats.hit_rate, 4)
    window["all_tokens"] = {"queries": stats.queries, "hits": stats.hits}
    pool = pool_summary(manager, recorder)
    disk = None
    if connector is not None and connector.store is not None:
        disk = {
            "bytes": connector.store.total_bytes,
            "capacity_bytes": connector.store.capacity_bytes,
            "hit_tokens": connector.stats.hit_tokens,
        }
    pins = manager.held.pins
    return {
        "time": time.time(),
        "block_size": manager.block_size,
        "kv_cache": kv_cache,
        "pool": pool,
        "tiers": {
            "ram": {"cached_blocks": pool["cached"], "capacity_blocks": manager.num_kv_blocks},
            "disk": disk,
            "remote": connector.remote_summary() if connector is not None else None,
        },
        "pins": {"count": len(pins.describe()), "blocks": pins.num_blocks},
        **window,
        "miss_reasons": dict(explainer.counts),
        "ghost": {
            "entries": len(recorder.ghosts),
            "capacity": recorder.ghosts.capacity,
            "bytes_bound": recorder.ghosts.bytes_bound(),
        },
        "top_prefixes": top,
        "tree": tree,
        "recent_reports": [
            {"request_id": rid, "tenant": tenant, "time": when, "report": report.to_dict()}
            for rid, tenant, when, report in reversed(explainer.recent)
        ],
    }


def merge_summaries(per_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Replicas' summaries as one: counts summed, a shared disk store counted once, hit rates
    recomputed from the summed tokens, each replica's tree under a node of its own, the lists
    merged and cut to one summary's length. `replicas` lists the ones that answered."""
    parts = list(per_replica.values())
    if not parts:
        raise ValueError("no replica answered")
    first = parts[0]
    pool: dict[str, Any] = {k: sum(p["pool"][k] for p in parts) for k in _POOL_COUNTS}
    by_tenant: dict[Any, int] = {}
    for part in parts:
        for row in part["pool"]["by_tenant"]:
            by_tenant[row["tenant"]] = by_tenant.get(row["tenant"], 0) + row["blocks"]
    pool["by_tenant"] = [
        {"tenant": t, "blocks": n} for t, n in sorted(by_tenant.items(), key=lambda kv: -kv[1])
    ]
    disks = [p["tiers"]["disk"] for p in parts if p["tiers"]["disk"] is not None]
    merged = {
        "time": max(p["time"] for p in parts),
        "build_s": max(p.get("build_s", 0.0) for p in parts),
        "block_size": first["block_size"],
        "kv_cache": first.get("kv_cache"),
        "replicas": sorted(per_replica),
        "pool": pool,
        "tiers": {
            "ram": {
                "cached_blocks": pool["cached"],
                "capacity_blocks": pool["num_blocks"],
            },
            "disk": max(disks, key=lambda d: d["bytes"]) if disks else None,
            "remote": _merged_remote([p["tiers"].get("remote") for p in parts]),
        },
        "pins": {k: sum(p["pins"][k] for p in parts) for k in ("count", "blocks")},
        "breakpoints": _merged_breakpoints([p.get("breakpoints") for p in parts]),
        "eviction": {k: sum(p["eviction"][k] for p in parts) for k in ("total", "per_s_60s")},
        "miss_reasons": _summed(parts, "miss_reasons"),
        "ghost": _summed(parts, "ghost"),
        "all_tokens": _summed(parts, "all_tokens"),
        "window_tokens": {
            key: _summed([p["window_tokens"] for p in parts], key) for key in first["window_tokens"]
        },
        "top_prefixes": sorted(
            (dict(t, replica=rid) for rid, p in per_replica.items() for t in p["top_prefixes"]),
            key=lambda t: (-t["hits"], -t["tokens"]),
        )[:TOP_PREFIXES],
        "tree": {
            "hash": "root",
            "blocks": 0,
            "tokens": 0,
            "hits": 0,
            "children": [
                {**p["tree"], "hash": f"replica-{rid}"} for rid, p in sorted(per_replica.items())
            ],
        },
        "recent_reports": sorted(
            (dict(r, replica=rid) for rid, p in per_replica.items() for r in p["recent_reports"]),
            key=lambda r: -r["time"],
        )[:RECENT_REPORTS],
    }
    merged["hit_rate"] = {key: _rate(t) for key, t in merged["window_tokens"].items()}
    merged["hit_rate"]["all"] = _rate(merged["all_tokens"]) or 0.0
    return merged


def _merged_breakpoints(views: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Replicas' held breakpoints as one: per tenant and in all, summed (each replica holds
    its own, within its own bounds)."""
    present = [v for v in views if v is not None]
    if not present:
        return None
    tenants: dict[str, dict[str, int]] = {}
    for view in present:
        for tenant, row in view["tenants"].items():
            into = tenants.setdefault(tenant, dict.fromkeys(row, 0))
            for key, value in row.items():
                into[key] = into.get(key, 0) + value
    keys = ("held_blocks", "capacity_blocks", "tenant_budget_blocks", "write_tokens")
    return {"tenants": tenants, **{k: sum(v[k] for v in present) for k in keys}}


def _merged_remote(remotes: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Replicas' views of the shared tier as one: their counts summed, connected when every
    replica's is (None when none has one)."""
    present = [r for r in remotes if r is not None]
    if not present:
        return None
    merged = {k: sum(r[k] for r in present) for k in present[0] if k != "connected"}
    merged["connected"] = all(r["connected"] for r in present)
    return merged


def _summed(parts: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {k: sum(p[key][k] for p in parts) for k in parts[0][key]}


def _rate(tokens: dict[str, int]) -> float | None:
    return round(tokens["hits"] / tokens["queries"], 4) if tokens["queries"] else None


_POOL_COUNTS = ("num_blocks", "in_use", "cached", "free", "pinned")
