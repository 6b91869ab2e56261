"""Reading speculative-decoding counters from a server's /metrics page, and what the tables make
of them."""

from __future__ import annotations

import pytest

from prefixserve.bench.client import RequestRecord
from prefixserve.bench.server_counters import (
    SpecDecodeStats,
    parse_prometheus,
    scrape_spec_decode,
    spec_decode_delta,
)
from prefixserve.bench.summary import markdown_table, summarize

# What vLLM 0.32's CPU server printed with --speculative-config ngram (abridged): labelled
# counters, each with a _created sample, and the per-position counter beside them.
VLLM_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="SmolLM2-135M-Instruct"} 13.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 52.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.79e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 49.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",position="0"} 13.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",position="1"} 12.0
"""

PREFIXSERVE_PAGE = """\
# HELP prefixserve_spec_decode_num_drafts_total Verifications of speculative drafts
# TYPE prefixserve_spec_decode_num_drafts_total counter
prefixserve_spec_decode_num_drafts_total 10.0
prefixserve_spec_decode_num_draft_tokens_total 40.0
prefixserve_spec_decode_num_accepted_tokens_total 30.0
prefixserve_num_requests_running 2.0
"""


def test_prometheus_text_sums_label_sets_and_skips_what_is_not_a_sample():
    page = (
        'a_total{engine="0"} 2.0\n'
        'a_total{engine="1",note="x } y"} 3.5 1700000000\n'
        "b 7\n"
        "# a comment 9\n"
        "\n"
        "c NaN\n"
        "d not-a-number\n"
    )
    assert parse_prometheus(page) == {"a_total": 5.5, "b": 7.0}


@pytest.mark.parametrize(
    ("page", "expected"),
    [(VLLM_PAGE, (13.0, 52.0, 49.0)), (PREFIXSERVE_PAGE, (10.0, 40.0, 30.0))],
)
def test_both_engines_counters_are_read(page, expected):
    stats = SpecDecodeStats.from_metrics(page)
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == expected
    drafts, draft_tokens, accepted = expected
    assert stats.acceptance_rate == accepted / draft_tokens
    assert stats.mean_accepted_length == 1 + accepted / drafts


def test_a_page_without_the_counters_gives_none_and_no_drafts_no_rates():
    assert SpecDecodeStats.from_metrics("prefixserve_num_requests_running 2.0\n") is None
    idle = SpecDecodeStats(0, 0, 0)
    assert idle.acceptance_rate is None and idle.mean_accepted_length is None


def test_a_runs_counts_are_the_difference_of_two_scrapes():
    before = SpecDecodeStats(10, 40, 30)
    after = SpecDecodeStats(14, 56, 38)
    assert spec_decode_delta(before, after) == {
        "num_drafts": 4,
        "num_draft_tokens": 16,
        "num_accepted_tokens": 8,
        "acceptance_rate": 0.5,
        "mean_accepted_length": 3.0,
    }
    assert spec_decode_delta(None, after)["num_drafts"] == 14  # no scrape before: since start
    assert spec_decode_delta(before, None) is None


def test_a_server_without_metrics_gives_none():
    assert scrape_spec_decode("http://127.0.0.1:9", timeout_s=1.0) is None


def test_the_table_shows_acceptance_only_when_a_row_has_it():
    rec = RequestRecord("a", start=0.0, ttft=0.1, itl=[0.01], e2e=0.2, output_tokens=4)
    plain = summarize([rec], 1.0)
    assert "accept rate" not in markdown_table([("vllm", plain)])
    spec = summarize([rec], 1.0).with_spec_decode(spec_decode_delta(None, SpecDecodeStats(2, 8, 6)))
    assert spec.to_dict()["acceptance_rate"] == 0.75 and spec.mean_accepted_length == 4.0
    lines = markdown_table([("vllm", plain), ("vllm+ngram", spec)]).splitlines()
    assert lines[0].endswith("| accept rate | mean acc len |") and lines[1].count("---") == 12
    assert lines[2].endswith("| n/a | n/a |") and lines[3].endswith("| 75.0% | 4.00 |")
    # a run with the counters but no draft: no rate
    idle = summarize([rec], 1.0).with_spec_decode(SpecDecodeStats(0, 0, 0).to_dict())
    assert idle.acceptance_rate is None
