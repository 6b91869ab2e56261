"""W8 over repeated `prefixserve bench compare` runs: one row per engine, median (min-max).

    .venv/bin/python benchmarks/w8_summary.py RUN_DIR [RUN_DIR ...] [--json OUT.json]

Each RUN_DIR is a compare `--out` directory holding `W8/<engine>.json`. Ratios against
round-robin are taken within each run (the same machine state), then their median is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

BASELINE = "prefixserve-2x1-round_robin"


def _row(result: dict[str, Any]) -> dict[str, float | None]:
    summary, cluster = result["summary"], result.get("cluster") or {}
    return {
        "req_s": summary["requests_per_s"],
        "ttft_p50": summary["ttft_ms"]["p50"],
        "ttft_p90": summary["ttft_ms"]["p90"],
        "ttft_p99": summary["ttft_ms"]["p99"],
        "hit_rate": summary["hit_rate"],
        "failed": summary["num_failed"],
        "computed": cluster.get("computed_prompt_tokens"),
        "imbalance": cluster.get("load_imbalance"),
        "decision_ms": cluster.get("decision_ms"),
    }


def load(runs: list[Path]) -> dict[str, list[dict[str, float | None]]]:
    """engine -> one row per run that has it; rows get `req_s_vs_rr` and `p99_vs_rr` when the
    run also has round-robin."""
    rows: dict[str, list[dict[str, float | None]]] = {}
    for run in runs:
        results = {p.stem: json.loads(p.read_text()) for p in sorted((run / "W8").glob("*.json"))}
        base = _row(results[BASELINE]) if BASELINE in results else None
        for engine, result in results.items():
            row = _row(result)
            if base is not None:
                row["req_s_vs_rr"] = row["req_s"] / base["req_s"]
                row["p99_vs_rr"] = row["ttft_p99"] / base["ttft_p99"]
            rows.setdefault(engine, []).append(row)
    return rows


def _cell(values: list[float | None], fmt: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    text = format(statistics.median(present), fmt)
    if len(present) > 1:
        text += f" ({format(min(present), fmt)}-{format(max(present), fmt)})"
    return text


COLUMNS = [
    ("req/s", "req_s", ".2f"),
    ("vs RR", "req_s_vs_rr", ".2f"),
    ("TTFT p50 ms", "ttft_p50", ",.0f"),
    ("p90", "ttft_p90", ",.0f"),
    ("p99", "ttft_p99", ",.0f"),
    ("p99 vs RR", "p99_vs_rr", ".2f"),
    ("hit rate", "hit_rate", ".3f"),
    ("computed", "computed", ",.0f"),
    ("imbalance", "imbalance", ".2f"),
    ("decision ms", "decision_ms", ".2f"),
]


def table(rows: dict[str, list[dict[str, float | None]]]) -> str:
    lines = [
        "| engine | runs | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for engine, runs in rows.items():
        cells = [_cell([r.get(key) for r in runs], fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {engine} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = load(args.runs)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
