"""Figures of the disk tier's benchmark: hit rate by tier over time, and TTFT by tier.

    .venv/bin/python benchmarks/bench_kv_store.py --workloads W4,W5,W6 --json kv_store.json
    .venv/bin/python benchmarks/plot_kv_store.py kv_store.json [--out docs/bench] [--window 8]

From the per-request records that `bench_kv_store.py --json` writes:
- `kv_store_hits_<W>.png` for each pressure workload (W4, W5, ...): the share of prompt tokens
  that hit in the RAM pool and on disk over a rolling window of requests, against the time of the
  run, with the RAM-only run's hit rate (LRU, the vLLM proxy) on the same axes. The disk run ends
  sooner: the x axis shows the throughput too.
- `kv_store_ttft_W6.png`: each W6 request's time to first token by where its prefix came from:
  no prefix cache, computed (a miss on the first pass), loaded from disk (after the restart), RAM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt  # noqa: E402

TIER_COLORS = {"RAM": "#4c72b0", "disk": "#dd8452", "computed": "#8c8c8c", "no cache": "#c44e52"}


def rolling_shares(
    records: list[dict], window: int
) -> tuple[list[float], list[float], list[float]]:
    """Finish times and the RAM and disk shares of prompt tokens over the last `window` requests."""
    times, ram, disk = [], [], []
    for i in range(len(records)):
        chunk = records[max(0, i + 1 - window) : i + 1]
        tokens = sum(r["prompt_tokens"] for r in chunk) or 1
        times.append(records[i]["seconds"])
        ram.append(sum(r["ram_hit_tokens"] for r in chunk) / tokens)
        disk.append(sum(r["disk_hit_tokens"] for r in chunk) / tokens)
    return times, ram, disk


def plot_hits(name: str, runs: dict, window: int, out: Path, subtitle: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t, ram, disk = rolling_shares(runs["ram_and_disk"], window)
    ax.stackplot(
        t,
        [ram, disk],
        labels=["RAM + disk run: RAM hits", "RAM + disk run: disk hits"],
        colors=[TIER_COLORS["RAM"], TIER_COLORS["disk"]],
        alpha=0.8,
        step="post",
    )
    t0, ram0, _ = rolling_shares(runs["ram_only"], window)
    ax.step(t0, ram0, where="post", color="black", label="RAM only (LRU): hits")
    ax.set_xlabel("seconds into the run (each point: a request finished)")
    ax.set_ylabel(f"prompt tokens hit, last {window} requests")
    ax.set_ylim(0, 1)
    ax.set_title(f"{name}: prefix-cache hits by tier over time\n{subtitle}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    path = out / f"kv_store_hits_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tier_of(record: dict) -> str:
    if record["disk_hit_tokens"]:
        return "disk"
    return "RAM" if record["ram_hit_tokens"] else "computed"


def plot_ttft(passes: dict, out: Path, subtitle: str) -> Path:
    groups: dict[str, list[float]] = {"no cache": [], "computed": [], "disk": [], "RAM": []}
    for name, records in passes.items():
        for r in records:
            groups["no cache" if name == "no_cache" else tier_of(r)].append(r["seconds"])
    labels = [k for k, v in groups.items() if v]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.boxplot([groups[k] for k in labels], showfliers=False)
    for i, label in enumerate(labels, start=1):
        values = groups[label]
        xs = [i + 0.25 * ((j % 7) / 6 - 0.5) for j in range(len(values))]
        ax.scatter(xs, values, s=10, color=TIER_COLORS[label], alpha=0.7, zorder=3)
    ax.set_xticks(range(1, len(labels) + 1))
    ax.set_xticklabels([f"{k}\n(n={len(groups[k])})" for k in labels])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, s (log)")
    ax.set_title(f"W6: TTFT by where the prefix came from\n{subtitle}", fontsize=10)
    path = out / "kv_store_ttft_W6.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", help="the JSON written by bench_kv_store.py --json")
    parser.add_argument("--out", default="docs/bench")
    parser.add_argument("--window", type=int, default=8, help="requests per rolling hit rate")
    args = parser.parse_args()
    data = json.loads(Path(args.records).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subtitle = f"flags: {data['cpu_flags'] or 'none of avx512/amx/avx2'}, {data['dtype']}"
    for name, runs in data["workloads"].items():
        if "ram_and_disk" in runs:
            print(plot_hits(name, runs, args.window, out, subtitle))
        else:
            print(plot_ttft(runs, out, subtitle))


if __name__ == "__main__":
    main()
