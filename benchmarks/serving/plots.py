"""One PNG per workload: requests/s (with hit rate), TTFT and ITL percentiles, TTFT CDF; and, for a
workload where an engine speculated, a second one: output tokens/s and acceptance rate by engine."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from prefixserve.bench.client import RequestRecord  # noqa: E402
from prefixserve.bench.summary import Summary  # noqa: E402


def _bars(ax: plt.Axes, names: Sequence[str], series: dict[str, list[float]], ylabel: str) -> None:
    x = np.arange(len(names))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        clean = [0.0 if v is None else v for v in values]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, clean, width, label=label)
    ax.set_xticks(x, names, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def plot_workload(
    workload: str,
    results: Sequence[tuple[str, Summary, Sequence[RequestRecord]]],
    path: Path,
    title: str | None = None,
) -> Path:
    """Write the figure of one workload to `path` (PNG) and return it.

    `results` holds (engine name, summary, records) per engine, in the order to draw them.
    """
    names = [name for name, _, _ in results]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    ax = axes[0, 0]
    _bars(ax, names, {"req/s": [s.requests_per_s for _, s, _ in results]}, "requests/s")
    for i, (_, s, _) in enumerate(results):
        label = "hit n/a" if s.hit_rate is None else f"hit {100 * s.hit_rate:.0f}%"
        ax.annotate(label, (i, s.requests_per_s), ha="center", va="bottom", fontsize=7)
    ax.margins(y=0.12)
    # Output tokens/s is requests/s times a fixed output length here: it is in the table only.
    _bars(
        axes[0, 1],
        names,
        {
            "TTFT p50": [s.ttft_ms[50] for _, s, _ in results],
            "TTFT p99": [s.ttft_ms[99] for _, s, _ in results],
        },
        "time to first token, ms",
    )
    _bars(
        axes[1, 0],
        names,
        {
            "ITL p50": [s.itl_ms[50] for _, s, _ in results],
            "ITL p99": [s.itl_ms[99] for _, s, _ in results],
        },
        "inter-token latency, ms",
    )
    ax = axes[1, 1]
    for name, _, records in results:
        ttfts = np.sort([r.ttft * 1000 for r in records if r.ok and r.ttft is not None])
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=name)
    ax.set_xlabel("TTFT ms", fontsize=8)
    ax.set_ylabel("share of requests", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title or workload, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    if any(s.acceptance_rate is not None for _, s, _ in results):
        plot_speculation(workload, results, spec_figure_path(path), title)
    return path


def spec_figure_path(path: Path) -> Path:
    """Where `plot_workload` puts the speculation figure: `<stem>-spec.png` beside its own."""
    return path.with_name(f"{path.stem}-spec.png")


def plot_speculation(
    workload: str,
    results: Sequence[tuple[str, Summary, Sequence[RequestRecord]]],
    path: Path,
    title: str | None = None,
) -> Path:
    """Output tokens/s and speculative decoding's acceptance rate (annotated with the mean
    accepted length) per engine, speculating or not, as one PNG at `path`."""
    names = [name for name, _, _ in results]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    ax = axes[0]
    _bars(
        ax, names, {"out tok/s": [s.output_tokens_per_s for _, s, _ in results]}, "output tokens/s"
    )
    for i, (_, s, _) in enumerate(results):
        y = s.output_tokens_per_s
        ax.annotate(f"{y:.0f}", (i, y), ha="center", va="bottom", fontsize=7)
    ax.margins(y=0.12)
    ax = axes[1]
    rates = [None if s.acceptance_rate is None else 100 * s.acceptance_rate for _, s, _ in results]
    _bars(ax, names, {"acceptance": rates}, "draft tokens accepted, %")
    ax.set_ylim(0, 105)
    for i, (_, s, _) in enumerate(results):
        if s.acceptance_rate is None:
            label, y = "no drafts", 0.0
        else:
            label, y = f"acc len {s.mean_accepted_length or 0:.2f}", 100 * s.acceptance_rate
        ax.annotate(label, (i, y), ha="center", va="bottom", fontsize=7)
    heading = f"{title or workload}; speculative decoding (acc len: tokens per verification)"
    fig.suptitle("\n".join(textwrap.wrap(heading, 110)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path
