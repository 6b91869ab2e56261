"""`bench_kv_attention.py`'s speculative steps (`--rows`): each sequence's query rows attend
through the kernel as the engine calls it, and a bad row count is refused."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_kv_attention
from prefixserve.model.kernels.build import paged_attention_kernel

NEEDS_KERNELS = pytest.mark.skipif(
    paged_attention_kernel() is None, reason="the native kernels are not built"
)


def _run(monkeypatch, capsys, *flags: str) -> str:
    argv = ["bench_kv_attention.py", "--layers", "1", "--steps", "1", "--repeats", "1", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    bench_kv_attention.main()
    return capsys.readouterr().out


@NEEDS_KERNELS
def test_rows_a_sequence_are_timed(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--batch", "2", "--context", "40", "--rows", "3",
               "--kv-cache-dtypes", "bf16")  # fmt: skip
    assert "batch 2, 3 rows each, context 40" in out
    [row] = [line for line in out.splitlines() if line.startswith("| bf16 |")]
    assert float(row.split("|")[3].split()[0]) > 0  # ms a step


@NEEDS_KERNELS
def test_a_row_count_under_one_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit, match="--rows must be at least 1"):
        _run(monkeypatch, capsys, "--batch", "1", "--context", "16", "--rows", "0")
