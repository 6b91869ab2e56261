"""The disk tier's figures: rolling hit shares by tier and TTFT classified by tier."""

from __future__ import annotations

import json

from benchmarks import plot_kv_store


def _r(seconds, prompt, ram, disk):
    return {
        "seconds": seconds,
        "prompt_tokens": prompt,
        "ram_hit_tokens": ram,
        "disk_hit_tokens": disk,
    }


def test_rolling_shares_are_token_weighted_over_the_window():
    records = [_r(1.0, 100, 0, 0), _r(2.0, 100, 50, 0), _r(3.0, 200, 0, 200)]
    times, ram, disk = plot_kv_store.rolling_shares(records, window=2)
    assert times == [1.0, 2.0, 3.0]
    assert ram == [0.0, 0.25, 50 / 300]
    assert disk == [0.0, 0.0, 200 / 300]


def test_a_request_is_classified_by_the_tier_its_prefix_came_from():
    assert plot_kv_store.tier_of(_r(0.1, 64, 0, 48)) == "disk"
    assert plot_kv_store.tier_of(_r(0.1, 64, 16, 32)) == "disk"
    assert plot_kv_store.tier_of(_r(0.1, 64, 48, 0)) == "RAM"
    assert plot_kv_store.tier_of(_r(0.1, 64, 0, 0)) == "computed"


def test_the_figures_are_written_from_the_benchmarks_records(tmp_path, monkeypatch):
    run = [_r(0.5 * i, 64, 16 * (i % 3), 16 * (i % 2)) for i in range(1, 12)]
    data = {
        "cpu_flags": "avx2",
        "dtype": "bfloat16",
        "workloads": {
            "W4": {"ram_only": run, "ram_and_disk": run},
            "W6": {"cold": run, "restart": run, "warm": run, "no_cache": run},
        },
    }
    path = tmp_path / "records.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "figures"
    monkeypatch.setattr("sys.argv", ["plot_kv_store.py", str(path), "--out", str(out)])
    plot_kv_store.main()
    for name in ("kv_store_hits_W4.png", "kv_store_ttft_W6.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
