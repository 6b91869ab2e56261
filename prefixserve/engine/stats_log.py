"""The engine's log lines: at start-up what runs and how big its cache is (`describe_engine`);
then periodically, vLLM-style, throughput over the interval, queues, KV usage and the prefix-cache
hit rate, logged when the async engine's step thread says (StatsLog)."""

from __future__ import annotations

import logging
import time
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.core.kv_cache.reports.ghost import EvictionGhosts


class StatsLog:
    """The step thread's logging state: log every `interval` seconds while busy, and once after
    the last busy interval; idle intervals log nothing."""

    def __init__(self) -> None:
        self.last_time = time.monotonic()
        self.last_metrics: dict[str, Any] | None = None
        self.steps = 0  # steps since the last line

    def seconds_until_due(self, interval: float | None) -> float | None:
        if interval is None or self.steps == 0:
            return None
        return self.last_time + interval - time.monotonic()

    def maybe_log(self, interval: float | None, engine: Any, logger: logging.Logger) -> None:
        if interval is None:
            return
        now = time.monotonic()
        if now - self.last_time < interval:
            return
        metrics = engine.get_metrics()
        if self.steps > 0 or engine.has_unfinished_requests():
            logger.info(format_stats(metrics, self.last_metrics, now - self.last_time))
        self.last_time = now
        self.last_metrics = dict(metrics)
        self.steps = 0


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


def describe_engine(engine: object, config: EngineConfig, served_names: list[str]) -> list[str]:
    """The start-up log lines: what runs, in which dtype, and how big the cache is.

    `engine` is an `EngineClient`; what it does not tell shows as '?'."""
    cache = config.cache
    num_blocks = getattr(engine, "num_kv_blocks", None)
    model_config = getattr(engine, "model_config", None)
    arch = getattr(model_config, "architecture", "?")
    path = getattr(engine, "model_path", None)
    source = config.model or "the default model"
    lines = [
        f"model: {source} (weights {path}; served as {', '.join(served_names)}; "
        f"architecture {arch}), dtype {config.dtype}, "
        f"max_model_len {getattr(engine, 'max_model_len', '?')}",
        f"KV cache: block size {cache.block_size} tokens, pool {num_blocks} blocks = "
        f"{num_blocks * cache.block_size if num_blocks else '?'} tokens, K/V stored as "
        f"{config.dtype if cache.kv_cache_dtype == 'auto' else cache.kv_cache_dtype} "
        "(--kv-cache-dtype)",
        f"prefix caching: {'on' if cache.enable_prefix_caching else 'off'}"
        + (f" (hash {cache.prefix_caching_hash_algo})" if cache.enable_prefix_caching else "")
        + f", KV events {'on' if cache.enable_kv_events else 'off'}",
        _ghost_line(cache.cache_ghost_entries),
        f"scheduler: max_num_seqs {config.scheduler.max_num_seqs}, "
        f"max_num_batched_tokens {config.scheduler.max_num_batched_tokens}, "
        f"policy {config.scheduler.scheduling_policy}",
        f"kernels: {getattr(engine, 'kernel_summary', '? (replicas: see their logs)')}",
    ]
    return lines


def _ghost_line(entries: int) -> str:
    bound = EvictionGhosts(entries).bytes_bound()
    return (
        f"cache reports: the ghost table remembers {entries} evicted block hashes, "
        f"at most {bound / 2**20:.1f} MiB (--cache-ghost-entries)"
    )
