"""The engine's periodic log line, vLLM-style: throughput over the interval, queues, KV usage,
prefix-cache hit rate."""

from __future__ import annotations

from typing import Any


def format_stats(metrics: dict[str, Any], previous: dict[str, Any] | None, elapsed_s: float) -> str:
    """The periodic log line: throughput over the interval, queue sizes, KV usage, hit rate."""
    previous = previous or {}

    def delta(key: str) -> float:
        return float(metrics.get(key, 0)) - float(previous.get(key, 0))

    elapsed_s = max(elapsed_s, 1e-9)
    queries = delta("prefix_cache_queries")
    hits = delta("prefix_cache_hits")
    hit_rate = f"{100.0 * hits / queries:.1f}%" if queries > 0 else "n/a"
    return (
        f"prompt throughput {delta('prompt_tokens') / elapsed_s:.1f} tok/s, "
        f"generation throughput {delta('generation_tokens') / elapsed_s:.1f} tok/s, "
        f"running {metrics.get('num_running', 0)} reqs, "
        f"waiting {metrics.get('num_waiting', 0)} reqs, "
        f"KV cache usage {100.0 * float(metrics.get('kv_cache_usage', 0.0)):.1f}%, "
        f"prefix cache hit rate {hit_rate}"
    )
