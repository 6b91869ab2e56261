"""Counters a server exports on GET /metrics that a benchmark run records: speculative decoding's
drafts, draft tokens and accepted tokens; with replicas, each replica's prompt tokens looked up
and found in its cache and the router's decisions (`scrape_cluster`).

prefixserve exports ``prefixserve_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``,
vLLM ``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` (labelled by engine and
model; the label sets are summed). Counters are cumulative over the server's life, so a run's
numbers are the difference of a scrape before it and one after it (`SpecDecodeStats.since`).
A server without /metrics (llama.cpp's), or without these counters, gives None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.core.sched.spec_metrics import acceptance

# Field -> the counter's exposed name, per engine, in the order they are looked up.
SPEC_DECODE_COUNTERS: dict[str, tuple[str, ...]] = {
    "num_drafts": (
        "prefixserve_spec_decode_num_drafts_total",
        "vllm:spec_decode_num_drafts_total",
    ),
    "num_draft_tokens": (
        "prefixserve_spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    "num_accepted_tokens": (
        "prefixserve_spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """{sample name: sum over all label sets} from Prometheus' text format (prometheus_client's
    parser); samples that are not finite numbers are skipped, and a page that does not parse
    gives what was read before the error."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if math.isfinite(sample.value):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:
        pass
    return totals


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative-decoding counters: verified drafts, draft tokens proposed, draft tokens
    accepted (vLLM's meaning: each accepted draft token is one output token that needed no
    forward pass of its own)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None when no draft was proposed."""
        return acceptance(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)[0]

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification (1 + accepted per draft); None without drafts."""
        return acceptance(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)[1]

    def since(self, before: SpecDecodeStats | None) -> SpecDecodeStats:
        """The counts from `before` (an earlier scrape of the same server) to these."""
        if before is None:
            return self
        return SpecDecodeStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    @classmethod
    def from_metrics(cls, text: str) -> SpecDecodeStats | None:
        """The counters in a /metrics page; None if it has none of them (a missing one of the
        three counts as 0)."""
        totals = parse_prometheus(text)
        found = False
        values: dict[str, float] = {}
        for field_name, names in SPEC_DECODE_COUNTERS.items():
            present = [n for n in names if n in totals]
            found = found or bool(present)
            values[field_name] = totals[present[0]] if present else 0.0
        return cls(**values) if found else None


def _metrics_page(base_url: str, timeout_s: float) -> str | None:
    """GET `base_url`/metrics; None when the server has none or does not answer."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def scrape_spec_decode(base_url: str, timeout_s: float = 10.0) -> SpecDecodeStats | None:
    """GET `base_url`/metrics and read the spec-decode counters; None when the server has no
    /metrics, does not answer, or exports none of them."""
    page = _metrics_page(base_url, timeout_s)
    return None if page is None else SpecDecodeStats.from_metrics(page)


def spec_decode_delta(
    before: SpecDecodeStats | None, after: SpecDecodeStats | None
) -> dict[str, Any] | None:
    """The run's counts (after minus before) as a JSON-ready dict; None without an `after`."""
    return None if after is None else after.since(before).to_dict()


# prefixserve with --replicas: per replica (labelled), and the router's (engine_router_*).
REPLICA_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "generation_tokens")
ROUTER_COUNTERS = (
    "router_decisions",
    "router_decision_seconds",
    "router_retried_requests",
    "router_failed_midstream",
    "router_event_gaps",
    "router_snapshots",
)


def scrape_cluster(base_url: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """{"replicas": {id: {counter: value}}, "router": {counter: value}} from a prefixserve server
    with replicas; None for any other server (or no answer)."""
    page = _metrics_page(base_url, timeout_s)
    if page is None:
        return None
    replicas: dict[str, dict[str, float]] = {}
    router: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                name = sample.name.removeprefix("prefixserve_")
                if name.startswith("replica_") and "replica" in sample.labels:
                    key = name.removeprefix("replica_")
                    if key in REPLICA_COUNTERS:
                        replicas.setdefault(sample.labels["replica"], {})[key] = sample.value
                elif name.removeprefix("engine_") in ROUTER_COUNTERS:
                    router[name.removeprefix("engine_")] = sample.value
    except ValueError:
        return None
    return {"replicas": replicas, "router": router} if router else None


def cluster_delta(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The run's share of the cluster counters, with what they make: tokens computed (looked up
    and not found) per replica, their imbalance (max / mean), the mean routing decision time."""
    if after is None:
        return None
    before = before or {"replicas": {}, "router": {}}
    replicas = {
        rid: {k: v - before["replicas"].get(rid, {}).get(k, 0.0) for k, v in values.items()}
        for rid, values in after["replicas"].items()
    }
    router = {k: v - before["router"].get(k, 0.0) for k, v in after["router"].items()}
    computed = {
        rid: v.get("prefix_cache_queries", 0.0) - v.get("prefix_cache_hits", 0.0)
        for rid, v in replicas.items()
    }
    mean = sum(computed.values()) / len(computed) if computed else 0.0
    decisions = router.get("router_decisions", 0.0)
    return {
        "replicas": replicas,
        "router": router,
        "computed_prompt_tokens": sum(computed.values()),
        "load_imbalance": max(computed.values()) / mean if mean else None,
        "decision_ms": 1e3 * router.get("router_decision_seconds", 0.0) / decisions
        if decisions
        else None,
    }
