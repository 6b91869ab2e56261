"""Prometheus metrics for GET /metrics.

Two sources: the engine's own counters and gauges (`LLMEngine.get_metrics()`, fetched at scrape
time and exported by a custom collector, so the numbers are the engine's, never a second count),
and latencies only the server sees (time to first token, inter-token latency, end-to-end time),
observed per request into histograms. Each app gets its own registry, so several servers (tests)
can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.core.kv_cache.reports.report import REASONS
from prefixserve.structured_output.errors import REJECTION_REASONS

PREFIX = "prefixserve_"

# Engine metric key -> (exported name, help). Counters are cumulative since start.
ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the RAM pool"),
    "kv_store_hit_tokens": ("prefix_cache_disk_hits", "Prompt tokens loaded from the disk tier"),
    "kv_store_bytes_read": ("kv_store_read_bytes", "Bytes read from the disk tier"),
    "kv_store_bytes_written": ("kv_store_written_bytes", "Bytes written to the disk tier"),
    "kv_store_load_seconds": ("kv_store_load_seconds", "Seconds spent loading from the disk tier"),
    "kv_store_dropped_writes": ("kv_store_dropped_writes", "Writes dropped by a full writer queue"),
    "kv_remote_hit_tokens": (
        "prefix_cache_remote_hits",
        "Prompt tokens loaded from the tier shared across hosts (--kv-remote)",
    ),
    "kv_remote_stored_blocks": ("kv_remote_stored_blocks", "Blocks written to the shared tier"),
    "kv_remote_dropped_writes": (
        "kv_remote_dropped_writes",
        "Blocks not written to the shared tier (its queue full, or the server refused)",
    ),
    "kv_remote_faults": (
        "kv_remote_faults",
        "Shared-tier calls that failed (server down, slow, refused): served as misses",
    ),
    "kv_remote_bad_values": (
        "kv_remote_bad_values",
        "Shared-tier values that were damaged, truncated or another block's: served as misses",
    ),
    "prefix_cache_requests": ("prefix_cache_requests", "Requests that queried the prefix cache"),
    "prefix_cache_write_tokens": (
        "prefix_cache_write_tokens",
        "Prompt tokens written to the cache at clients' breakpoints (cache_control, 24h retention)",
    ),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of requests admitted by the scheduler"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "num_preemptions": ("num_preemptions", "Requests preempted to free KV-cache blocks"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Verifications of speculative drafts"),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted (emitted without a forward pass of their own)",
    ),
    "structured_output_compiles": (
        "structured_output_compiles",
        "Grammars compiled for structured outputs (JSON Schema, regex, choice, Lark), "
        "successfully or not",
    ),
    "structured_output_cache_hits": (
        "structured_output_cache_hits",
        "Structured requests whose grammar was already compiled or compiling for their client",
    ),
    "structured_output_compile_seconds": (
        "structured_output_compile_seconds",
        "Seconds spent compiling grammars",
    ),
}
ENGINE_GAUGES = {
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)"),
    "num_running": ("num_requests_running", "Requests in the running batch"),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_cached_blocks": (
        "kv_cache_cached_blocks",
        "Distinct prefix blocks cached in the RAM pool (hittable, in use or free)",
    ),
    "kv_cache_pinned_blocks": ("kv_cache_pinned_blocks", "Blocks held resident by pins"),
    "kv_cache_breakpoint_blocks": (
        "kv_cache_breakpoint_blocks",
        "Blocks held resident by clients' cache breakpoints until their ttl runs out",
    ),
    "kv_cache_breakpoints": ("kv_cache_breakpoints", "Cache breakpoints held"),
    "kv_cache_bytes_per_token": (
        "kv_cache_bytes_per_token",
        "Bytes of one token's K and V over every layer, as the pool stores them",
    ),
    "kv_remote_connected": (
        "kv_remote_connected",
        "1 when the shared tier's latest call reached its server, 0 after a fault (with "
        "replicas: how many are connected)",
    ),
    "cache_ghost_entries": (
        "cache_ghost_entries",
        "Evicted block hashes remembered for cache reports (bounded by --cache-ghost-entries)",
    ),
    "structured_output_cached_grammars": (
        "structured_output_cached_grammars",
        "Grammars cached, over every client (a constraint that failed to compile too, so it is "
        "refused again without compiling; bounded per client by --max-cached-grammars-per-tenant)",
    ),
}
# Engine keys `cache_miss_<reason>` -> one counter labelled by reason (docs/cache_reports.md).
MISS_REASON_KEY = "cache_miss_"
# Engine keys `structured_output_rejections_<reason>` -> one counter labelled by reason
# (docs/structured_outputs.md).
REJECTION_KEY = "structured_output_rejections_"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    """Exports the latest `LLMEngine.get_metrics()` dict handed to `update`."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        latest = self.latest
        for key, (name, doc) in ENGINE_COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc)
            counter.add_metric([], float(latest.get(key, 0)))
            yield counter
        for key, (name, doc) in ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc)
            gauge.add_metric([], float(latest.get(key, 0)))
            yield gauge
        yield from _by_reason(latest)
        if isinstance(latest.get("kv_cache_dtype"), str):
            info = GaugeMetricFamily(
                PREFIX + "kv_cache_dtype_info",
                "How the KV cache stores K/V (--kv-cache-dtype): 1 for the engine's dtype",
                labels=["kv_cache_dtype"],
            )
            info.add_metric([latest["kv_cache_dtype"]], 1.0)
            yield info
        # Anything else numeric the engine reports, as a gauge under its own name.
        for key, value in sorted(latest.items()):
            if key in ENGINE_COUNTERS or key in ENGINE_GAUGES:
                continue
            if key.startswith((MISS_REASON_KEY, REJECTION_KEY)):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            gauge = GaugeMetricFamily(PREFIX + "engine_" + key, f"engine metric {key}")
            gauge.add_metric([], float(value))
            yield gauge
        # With replicas (cluster/): each replica's numbers, labelled (the above are their sums).
        replicas = latest.get("replicas") or {}
        keys = sorted({k for m in replicas.values() for k, v in m.items() if _is_number(v)})
        for key in keys:
            gauge = GaugeMetricFamily(
                PREFIX + "replica_" + key, f"engine metric {key} of one replica", labels=["replica"]
            )
            for rid, metrics in sorted(replicas.items()):
                if _is_number(metrics.get(key)):
                    gauge.add_metric([str(rid)], float(metrics[key]))
            yield gauge


def _by_reason(latest: dict[str, Any]) -> Iterator[Metric]:
    """The engine's per-reason keys as counters labelled by reason: cache misses and
    structured-output rejections."""
    misses = CounterMetricFamily(
        PREFIX + "cache_miss_reasons",
        "Requests by the reason their first missed prompt block was not served from the "
        "cache (one per request, at its first scheduling)",
        labels=["reason"],
    )
    for reason in REASONS:
        misses.add_metric([reason], float(latest.get(MISS_REASON_KEY + reason, 0)))
    yield misses
    rejections = CounterMetricFamily(
        PREFIX + "structured_output_rejections",
        "Structured requests refused before they were queued, by reason: a schema that is "
        "not valid JSON Schema, one using what the grammar engine does not support, a regex "
        "or grammar that does not parse, a compile past its time bound (400s), a client "
        "with too many compiles in flight (429)",
        labels=["reason"],
    )
    for reason in REJECTION_REASONS:
        rejections.add_metric([reason], float(latest.get(REJECTION_KEY + reason, 0)))
    yield rejections


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ServerMetrics:
    """The registry behind /metrics, and the histograms the request handlers observe into."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive generated tokens of a request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason (stop, length, abort)",
            ["finished_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            PREFIX + "request_errors",
            "Responses with a 4xx/5xx status, by status and OpenAI error code",
            ["status", "code"],
            registry=self.registry,
        )
        self.body_bytes_in_flight = Gauge(
            PREFIX + "request_body_bytes_in_flight",
            "Bytes of request bodies held by requests still being served (the request guard's "
            "count against --max-body-bytes-in-flight)",
            registry=self.registry,
        )
        self.cached_prompt_tokens = Counter(
            PREFIX + "request_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache, as reported to clients in usage",
            registry=self.registry,
        )
        self.cache_write_prompt_tokens = Counter(
            PREFIX + "request_cache_write_prompt_tokens",
            "Prompt tokens written at breakpoints, as reported to clients "
            "(cache_creation_input_tokens)",
            registry=self.registry,
        )

    def update_engine(self, metrics: dict[str, Any]) -> None:
        self._engine.latest = dict(metrics)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, inter-token latencies and end-to-end time."""

    __slots__ = ("metrics", "arrival", "last_token_time", "num_tokens")

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def on_tokens(self, now: float, num_tokens: int) -> None:
        """`num_tokens` (total over the request's sequences) were seen at `now`."""
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        if self.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            gap = (now - self.last_token_time) / new
            for _ in range(new):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_time = now
        self.num_tokens = num_tokens

    def on_finish(self, now: float, finish_reasons: list[str | None]) -> None:
        self.metrics.e2e_request_latency.observe(now - self.arrival)
        for reason in finish_reasons:
            self.metrics.request_success.labels(finished_reason=reason or "abort").inc()
