"""Counters a server exports on GET /metrics that a benchmark run records: speculative decoding's
drafts, draft tokens and accepted tokens.

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
    """{metric name: sum of its samples over all label sets} from Prometheus' text format.

    Comments, blank lines and samples whose value is not a finite number are skipped; the
    optional timestamp after the value is ignored. Label values may hold spaces and braces."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            # the label set ends at the last "}" (quoted label values may hold "}")
            rest = rest[rest.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        name = name.strip()
        totals[name] = totals.get(name, 0.0) + value
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
        if self.num_draft_tokens <= 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification: 1 + accepted draft tokens per draft; None when no
        draft was verified."""
        if self.num_drafts <= 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

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


def scrape_spec_decode(base_url: str, timeout_s: float = 10.0) -> SpecDecodeStats | None:
    """GET `base_url`/metrics and read the spec-decode counters; None when the server has no
    /metrics, does not answer, or exports none of them."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return SpecDecodeStats.from_metrics(response.text)


def spec_decode_delta(
    before: SpecDecodeStats | None, after: SpecDecodeStats | None
) -> dict[str, Any] | None:
    """The run's counts (after minus before) as a JSON-ready dict; None without an `after`."""
    return None if after is None else after.since(before).to_dict()
