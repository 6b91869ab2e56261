"""W9's summaries and result files: requests/s, TTFT p50/p99 of the turns >= 1 (all of them, and
those answered in text), the cached share of those turns' prompt tokens, the parse rate; one
markdown row per server, with whether it was still alive after the run.

`<out>/W9/<engine>.json` holds the config, whether the server was alive, the summary and every
record (`agent_workload.AgentRecord`); `load_agent_results` reads them back for the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixserve.bench.agent_workload import AgentConfig, AgentRecord, AgentRun
from prefixserve.bench.summary import SPEC_HEADER, percentiles, spec_cells, with_spec_decode


@dataclass(slots=True)
class AgentSummary:
    """One server on W9. Times in ms. `later_*` are over the turns >= 1; `cached_share` is None
    when no later turn reported cached tokens; `parse_rate` over the turns that had to call or
    did (`parse_checked`); `forced_parsed` of `forced_turns` required turns."""

    num_requests: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    later_ttft_ms: dict[int, float | None]
    later_text_ttft_ms: dict[int, float | None]
    e2e_ms: dict[int, float | None]
    later_prompt_tokens: int
    later_cached_tokens: int
    cached_share: float | None
    cached_sources: list[str]
    parse_checked: int
    parse_ok: int
    forced_turns: int
    forced_parsed: int
    calls_made: int
    # Speculative decoding over the run, where the server exports its counters (W9 with n-gram).
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None

    def with_spec_decode(self, spec_decode: dict[str, Any] | None) -> AgentSummary:
        return with_spec_decode(self, spec_decode)

    @property
    def parse_rate(self) -> float | None:
        return self.parse_ok / self.parse_checked if self.parse_checked else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("later_ttft_ms", "later_text_ttft_ms", "e2e_ms"):
            d[key] = {f"p{p}": v for p, v in d[key].items()}
        d["parse_rate"] = self.parse_rate
        return d


def _ms(seconds: Iterable[float | None]) -> dict[int, float | None]:
    return percentiles([s * 1000 for s in seconds if s is not None], (50, 99))


def summarize_agent(records: Sequence[AgentRecord], duration_s: float) -> AgentSummary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn >= 1]
    reporting = [r for r in later if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in reporting)
    cached = sum(r.cached_tokens or 0 for r in reporting)
    checked = [r for r in records if r.parse_ok is not None]
    forced = [r for r in records if r.tool_choice == "required"]
    return AgentSummary(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s,
        later_ttft_ms=_ms(r.ttft for r in later),
        later_text_ttft_ms=_ms(r.ttft for r in later if not r.tool_calls),
        e2e_ms=_ms(r.e2e for r in ok),
        later_prompt_tokens=prompt,
        later_cached_tokens=cached,
        cached_share=cached / prompt if prompt else None,
        cached_sources=sorted({r.cached_source for r in ok if r.cached_source}),
        parse_checked=len(checked),
        parse_ok=sum(1 for r in checked if r.parse_ok),
        forced_turns=len(forced),
        forced_parsed=sum(1 for r in forced if r.parse_ok),
        calls_made=sum(len(r.tool_calls) for r in ok),
    )


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


AGENT_TABLE_HEADER = (
    "| engine | req/s | TTFT p50 / p99 ms (turns >= 1) | TTFT p50 / p99 ms (text answers, "
    "turns >= 1) | cached share (turns >= 1) | parse rate | forced calls parsed | failed "
    "| alive |"
)


def agent_table(rows: Sequence[tuple[str, AgentSummary, bool | None]]) -> str:
    """A markdown table, one row per (engine, summary, alive after the run); with speculative
    decoding's acceptance rate and mean accepted length when any row has them."""
    spec = any(s.acceptance_rate is not None for _, s, _ in rows)
    lines = [AGENT_TABLE_HEADER + (SPEC_HEADER if spec else ""), "|" + "---|" * (11 if spec else 9)]
    for name, s, alive in rows:
        share = "n/a" if s.cached_share is None else f"{100 * s.cached_share:.1f}%"
        rate = "n/a" if s.parse_rate is None else f"{100 * s.parse_rate:.1f}%"
        lines.append(
            f"| {name} | {s.requests_per_s:.2f} "
            f"| {_fmt(s.later_ttft_ms[50])} / {_fmt(s.later_ttft_ms[99])} "
            f"| {_fmt(s.later_text_ttft_ms[50])} / {_fmt(s.later_text_ttft_ms[99])} "
            f"| {share} | {rate} ({s.parse_ok}/{s.parse_checked}) "
            f"| {s.forced_parsed}/{s.forced_turns} | {s.num_failed} "
            f"| {'n/a' if alive is None else ('yes' if alive else 'NO')} |"
            + (spec_cells(s.acceptance_rate, s.mean_accepted_length) if spec else "")
        )
    return "\n".join(lines)


def result_payload(
    engine: str, config: AgentConfig, run: AgentRun, alive: bool | None, **extra: Any
) -> dict[str, Any]:
    """What `<out>/W9/<engine>.json` holds (`extra`: the server's command, its speculative-
    decoding counters over the run as `spec_decode`, ...)."""
    summary = summarize_agent(run.records, run.duration).with_spec_decode(extra.get("spec_decode"))
    return {
        "engine": engine,
        "workload": "W9",
        "kind": "agent",
        "description": config.describe(),
        "config": asdict(config),
        "alive": alive,
        **extra,
        "summary": summary.to_dict(),
        "run": run.to_dict(),
    }


def load_agent_results(
    folder: Path, order: Sequence[str] = ()
) -> list[tuple[str, AgentSummary, bool | None]]:
    """Every engine's W9 result in `folder` (`<out>/W9`), engines in `order` first."""
    rank = {name: i for i, name in enumerate(order)}
    rows = []
    if not folder.is_dir():
        return rows
    for path in sorted(folder.glob("*.json"), key=lambda p: (rank.get(p.stem, 99), p.stem)):
        data = json.loads(path.read_text())
        records = [AgentRecord.from_dict(r) for r in data["run"]["records"]]
        summary = summarize_agent(records, data["run"]["duration"])
        rows.append(
            (data["engine"], summary.with_spec_decode(data.get("spec_decode")), data.get("alive"))
        )
    return rows
