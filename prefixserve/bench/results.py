"""Result files of a benchmark run and the tables made from them.

Each engine's run of a workload is one ``<out>/<workload>/<engine>.json`` (with ``spec_decode``:
the server's speculative-decoding counters over the run, where it exports them); `report` reads
every such file of a workload back and writes ``<out>/<workload>.md`` (one table row per engine) and
``<out>/summary.json`` (every engine's summary per workload), so runs of different engines into
the same directory add up. W9 (agents, `agent_workload`) has its own records and table, and no
figure. Figures are drawn by a `plot` function passed in (the comparison
harness in the checkout's benchmarks/serving/ passes its matplotlib one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefixserve.bench.agent_summary import agent_table, load_agent_results
from prefixserve.bench.agent_workload import AGENT_WORKLOADS
from prefixserve.bench.client import RequestRecord
from prefixserve.bench.summary import Summary, markdown_table, summarize

EngineResult = tuple[str, Summary, list[RequestRecord]]
# plot(workload, results, png path, title)
PlotFn = Callable[[str, Sequence[EngineResult], Path, str], object]


def result_path(out_dir: Path, workload: str, engine: str) -> Path:
    return out_dir / workload / f"{engine}.json"


def load_results(out_dir: Path, workload: str, order: Sequence[str] = ()) -> list[EngineResult]:
    """Every engine result of `workload` under `out_dir`: engines named in `order` first, in that
    order, then the others by name."""
    found: list[EngineResult] = []
    folder = out_dir / workload
    if not folder.is_dir():
        return found
    rank = {name: i for i, name in enumerate(order)}
    for path in sorted(folder.glob("*.json"), key=lambda p: (rank.get(p.stem, 99), p.stem)):
        data = json.loads(path.read_text())
        records = [RequestRecord(**r) for r in data["run"]["records"]]
        summary = summarize(records, data["run"]["duration"])
        found.append((data["engine"], summary.with_spec_decode(data.get("spec_decode")), records))
    return found


def report(
    out_dir: Path,
    workloads: Sequence[str],
    order: Sequence[str] = (),
    plot: PlotFn | None = None,
) -> str:
    """Write `<workload>.md` (and, with `plot`, `<workload>.png`) for each workload that has
    results, and `summary.json` (every engine's summary per workload); return all tables.
    `order` is the row order of the engines (see `load_results`)."""
    parts: list[str] = []
    summaries: dict[str, dict[str, Any]] = {}
    for name in workloads:
        if name in AGENT_WORKLOADS:
            rows = load_agent_results(out_dir / name, order)
            if rows:
                summaries[name] = {engine: s.to_dict() for engine, s, _ in rows}
                table = agent_table(rows)
                (out_dir / f"{name}.md").write_text(table + "\n")
                parts.append(f"### {name}\n\n{table}\n")
            continue
        results = load_results(out_dir, name, order)
        if not results:
            continue
        summaries[name] = {engine: s.to_dict() for engine, s, _ in results}
        table = markdown_table([(engine, s) for engine, s, _ in results])
        (out_dir / f"{name}.md").write_text(table + "\n")
        if plot is not None:
            first = json.loads(next((out_dir / name).glob("*.json")).read_text())
            plot(name, results, out_dir / f"{name}.png", f"{name}: {first.get('description', '')}")
        parts.append(f"### {name}\n\n{table}\n")
    if summaries:
        (out_dir / "summary.json").write_text(json.dumps(summaries, indent=1))
    return "\n".join(parts)
