from __future__ import annotations

import pytest

from prefixserve.bench.client import RequestRecord
from prefixserve.bench.summary import markdown_table, percentiles, summarize


def _rec(rid, ttft, itl, e2e, prompt, out, cached=None, error=None):
    return RequestRecord(
        rid,
        start=0.0,
        ttft=ttft,
        itl=list(itl),
        e2e=e2e,
        prompt_tokens=prompt,
        output_tokens=out,
        cached_tokens=cached,
        error=error,
    )


def test_percentiles_interpolate_linearly_and_handle_empty():
    assert percentiles(list(range(1, 101)), (50, 90, 99)) == {
        50: pytest.approx(50.5),
        90: pytest.approx(90.1),
        99: pytest.approx(99.01),
    }
    assert percentiles([7.0]) == {50: 7.0, 90: 7.0, 99: 7.0}
    assert percentiles([]) == {50: None, 90: None, 99: None}


def test_summary_rates_latencies_and_hit_rate():
    records = [
        _rec("a", 0.1, [0.01, 0.03], 0.14, prompt=100, out=3, cached=50),
        _rec("b", 0.3, [0.02], 0.32, prompt=300, out=2, cached=0),
        _rec("c", 0.2, [], 0.2, prompt=100, out=1),  # no cached_tokens reported
        _rec("d", None, [], None, prompt=100, out=0, error="HTTP 500"),
    ]
    s = summarize(records, duration_s=2.0)
    assert s.num_requests == 4 and s.num_failed == 1
    assert s.requests_per_s == pytest.approx(1.5)  # 3 ok in 2 s
    assert s.output_tokens_per_s == pytest.approx(3.0)  # 6 tokens in 2 s
    assert s.total_prompt_tokens == 500
    assert s.ttft_ms[50] == pytest.approx(200.0)
    assert s.itl_ms[50] == pytest.approx(20.0)  # pooled gaps 10, 20, 30
    # Per token after the first: a (140 - 100) / 2 = 20, b (320 - 300) / 1 = 20; c has one token.
    assert s.tpot_ms == {50: pytest.approx(20.0), 90: pytest.approx(20.0), 99: pytest.approx(20.0)}
    assert s.e2e_ms[99] == pytest.approx(200 + 0.98 * 120)  # sorted 140, 200, 320
    assert s.hit_rate == pytest.approx(50 / 400)  # only a and b reported


def test_hit_rate_is_none_when_no_server_reports_it():
    s = summarize([_rec("a", 0.1, [], 0.1, 10, 1)], duration_s=1.0)
    assert s.hit_rate is None
    assert "n/a" in markdown_table([("x", s)])


def test_summary_refuses_a_non_positive_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)


def test_markdown_table_has_one_row_per_engine_and_json_friendly_dict():
    s = summarize([_rec("a", 0.1, [0.01], 0.11, 10, 2, cached=5)], duration_s=1.0)
    table = markdown_table([("prefixserve", s), ("vllm", s)])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| prefixserve | 1.00 | 2.0 | 100.0 |")
    assert "50.0%" in lines[2]
    d = s.to_dict()
    assert d["ttft_ms"]["p50"] == pytest.approx(100.0) and d["hit_rate"] == 0.5
