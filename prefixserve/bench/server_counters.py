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
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.spec_decode.metrics import acceptance

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
