"""Summaries of a run: throughput, latency percentiles and prefix-cache hit rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prefixserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentiles(
    values: Sequence[float], ps: Sequence[int] = PERCENTILES
) -> dict[int, float | None]:
    """Linear-interpolated percentiles of `values` (numpy's default); None for an empty list."""
    if len(values) == 0:
        return {p: None for p in ps}
    arr = np.asarray(values, dtype=np.float64)
    return {p: float(np.percentile(arr, p)) for p in ps}


@dataclass(slots=True)
class Summary:
    """One engine on one workload. Latencies in milliseconds; rates per second of wall time.

    `hit_rate` is the share of prompt tokens the server reported as cached, over the requests
    that reported `cached_tokens`; None when no request reported it. `acceptance_rate` (accepted
    / proposed draft tokens) and `mean_accepted_length` (1 + accepted per draft) are speculative
    decoding's, from the server's /metrics counters over the run (not from the records: see
    `with_spec_decode`); None for a server that does not speculate or export them.
    """

    num_requests: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_ms: dict[int, float | None]
    itl_ms: dict[int, float | None]
    # Time per output token after the first, per request: (e2e - ttft) / (tokens - 1). Unlike ITL
    # (per streamed chunk) it counts tokens, so speculative decoding's multi-token chunks compare.
    tpot_ms: dict[int, float | None]
    e2e_ms: dict[int, float | None]
    hit_rate: float | None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None

    def with_spec_decode(self, spec_decode: dict[str, Any] | None) -> Summary:
        return with_spec_decode(self, spec_decode)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            d[key] = {f"p{p}": v for p, v in d[key].items()}
        return d


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    """Summarize the records of one run that took `duration_s` seconds of wall time.

    Failed requests count in `num_failed` and in nothing else.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    reporting = [r for r in ok if r.cached_tokens is not None]
    reported_prompt = sum(r.prompt_tokens for r in reporting)
    hit_rate = (
        sum(r.cached_tokens or 0 for r in reporting) / reported_prompt
        if reporting and reported_prompt > 0
        else None
    )
    ms = 1000.0
    return Summary(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s,
        output_tokens_per_s=out_tokens / duration_s,
        total_prompt_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=out_tokens,
        ttft_ms=percentiles([r.ttft * ms for r in ok if r.ttft is not None]),
        itl_ms=percentiles([gap * ms for r in ok for gap in r.itl]),
        tpot_ms=percentiles(
            [
                (r.e2e - r.ttft) * ms / (r.output_tokens - 1)
                for r in ok
                if r.e2e is not None and r.ttft is not None and r.output_tokens > 1
            ]
        ),
        e2e_ms=percentiles([r.e2e * ms for r in ok if r.e2e is not None]),
        hit_rate=hit_rate,
    )


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


TABLE_HEADER = (
    "| engine | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
    "| TPOT p50 ms | hit rate | failed |"
)


SPEC_HEADER = " accept rate | mean acc len |"


def with_spec_decode(summary: Any, spec_decode: dict[str, Any] | None) -> Any:
    """`summary` (a `Summary` or an `agent_summary.AgentSummary`) with the acceptance numbers of
    a run's recorded spec-decode counters (`server_counters.spec_decode_delta`'s dict, or None)."""
    if spec_decode:
        summary.acceptance_rate = spec_decode.get("acceptance_rate")
        summary.mean_accepted_length = spec_decode.get("mean_accepted_length")
    return summary


def spec_cells(acceptance_rate: float | None, mean_accepted_length: float | None) -> str:
    """The `SPEC_HEADER` columns of a table row."""
    rate = "n/a" if acceptance_rate is None else f"{100 * acceptance_rate:.1f}%"
    return f" {rate} | {_fmt(mean_accepted_length, 2)} |"


def markdown_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A markdown table with one row per (engine name, summary); with speculative decoding's
    acceptance rate and mean accepted length when any row has them."""
    spec = any(s.acceptance_rate is not None for _, s in rows)
    header = TABLE_HEADER + (SPEC_HEADER if spec else "")
    lines = [header, "|" + "---|" * (12 if spec else 10)]
    for name, s in rows:
        hit = "n/a" if s.hit_rate is None else f"{100 * s.hit_rate:.1f}%"
        line = (
            f"| {name} | {s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} "
            f"| {_fmt(s.ttft_ms[50])} | {_fmt(s.ttft_ms[99])} "
            f"| {_fmt(s.itl_ms[50])} | {_fmt(s.itl_ms[99])} | {_fmt(s.tpot_ms[50])} "
            f"| {hit} | {s.num_failed} |"
        )
        if spec:
            line += spec_cells(s.acceptance_rate, s.mean_accepted_length)
        lines.append(line)
    return "\n".join(lines)
