"""The n-gram proposer and the speculative_config option, without a model."""

from __future__ import annotations

import json
import random

import pytest

from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from prefixserve.spec_decode import SpeculativeConfig, speculative_config_from
from prefixserve.spec_decode.ngram import MAX_PAUSE_STEPS, NgramProposer


def proposer(k=4, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    )


def decoding(tokens: list[int], request_id: str = "r", max_tokens: int | None = None) -> Request:
    """A request whose last token is the only one not computed (a decode step)."""
    request = Request(request_id, tokens, SamplingParams(max_tokens=max_tokens or 16))
    request.num_computed_tokens = len(tokens) - 1
    return request


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """From scratch: the latest earlier occurrence of the longest suffix n-gram in [lo, hi]."""
    last = len(tokens) - 1
    for n in range(min(hi, last), lo - 1, -1):
        suffix = tokens[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = proposer(k=3, lo=2, hi=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 9, 6, 7, 2, 8, 6, 7]
    # "6 7" occurs ending at 2 and 6: the latest (6) is followed by 2, 8, 6.
    assert p.propose(decoding(tokens), 3) == [2, 8, 6]


def test_ngram_prefers_the_longest_match():
    p = proposer(k=2, lo=1, hi=3)
    #         0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    # "3" alone last occurred at 5 (-> 5, 1), but "1 2 3" occurs at 0..2 (-> 4, 9).
    assert p.propose(decoding(tokens), 2) == [4, 9]


def test_ngram_never_matches_the_suffix_itself_and_respects_min():
    p = proposer(k=4, lo=2, hi=4)
    assert p.propose(decoding([1, 2, 3, 4]), 4) == []  # no earlier occurrence of any n-gram
    assert p.propose(decoding([7, 3, 9, 7]), 4) == []  # only a 1-gram repeats: below min


def test_ngram_drafts_are_capped_by_most_and_by_the_context():
    p = proposer(k=4, lo=1, hi=1)
    assert p.propose(decoding([3, 8, 9, 3]), 2) == [8, 9]
    assert p.propose(decoding([3, 8, 3], "s"), 4) == [8, 3]  # runs to the end of the tokens


def test_ngram_incremental_index_matches_a_search_from_scratch():
    rng = random.Random(0)
    for trial in range(30):
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        p = proposer(k, lo, hi)
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(2, 8))]
        request = decoding(tokens, f"r{trial}", max_tokens=200)
        for _ in range(40):
            assert p.propose(request, k) == reference(request.all_token_ids, k, lo, hi)
            request.append_output_token_ids([rng.randint(0, 5) for _ in range(rng.randint(1, 3))])
            request.num_computed_tokens = request.num_tokens - 1


def test_ngram_draft_length_follows_acceptance():
    p = proposer(k=4, lo=1, hi=1)
    request = decoding([1, 2, 3, 4, 5, 6, 1], max_tokens=100)
    assert len(p.propose(request, 8)) == 4
    p.record("r", 4, 1)  # one accepted: propose two next
    assert p.propose(request, 8) == [2, 3]
    p.record("r", 2, 2)  # all accepted: one more
    assert p.propose(request, 8) == [2, 3, 4]


def test_ngram_pauses_after_drafts_are_rejected_twice_and_comes_back():
    p = proposer(k=4, lo=1, hi=1)
    request = decoding([1, 2, 3, 4, 1], max_tokens=100)
    assert p.propose(request, 4)
    p.record("r", 4, 0)
    assert p.propose(request, 4)  # one miss: still proposing (one draft)
    p.record("r", 1, 0)
    assert [p.propose(request, 4) for _ in range(2)] == [[], []]  # paused 2 steps
    assert p.propose(request, 4) == [2]
    for _ in range(10):
        p.record("r", 1, 0)
    skipped = 0
    while not p.propose(request, 4):
        skipped += 1
    assert skipped == MAX_PAUSE_STEPS
    p.record("r", 1, 1)  # accepted: no more pauses
    assert p.propose(request, 4)


def test_ngram_propose_within_keeps_drafts_inside_budget_max_tokens_and_model_len():
    p = proposer(k=8, lo=1, hi=1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert p.propose_within(decoding(tokens, "a", max_tokens=100), 4, max_model_len=1000) == [
        2,
        3,
        4,
    ]
    assert p.propose_within(decoding(tokens, "b", max_tokens=3), 100, max_model_len=1000) == [2, 3]
    assert p.propose_within(decoding(tokens, "c", max_tokens=100), 100, max_model_len=12) == [2]
    assert p.propose_within(decoding(tokens, "d", max_tokens=1), 100, max_model_len=1000) == []
    prefill = Request("e", tokens, SamplingParams(max_tokens=10))  # nothing computed yet
    assert p.propose_within(prefill, 100, max_model_len=1000) == []


def test_ngram_drop_forgets_finished_requests():
    p = proposer()
    p.propose(decoding([1, 2, 1], "x"), 2)
    p.propose(decoding([1, 2, 1], "y"), 2)
    p.drop(["x", "unknown"])
    assert p.num_tracked == 1


def test_speculative_config_follows_vllm_defaults_and_names():
    both = speculative_config_from({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = speculative_config_from(
        json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert speculative_config_from(None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"num_speculative_tokens": 2}, "needs method"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "lookup_min"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "at most prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "hold_for_prefill": 1}, "hold_for"),
    ],
)
def test_speculative_config_rejects_bad_values_naming_them(value, message):
    with pytest.raises(ValueError, match=message):
        speculative_config_from(value)


def test_ngram_drafts_leave_a_token_to_every_later_running_request_and_keep_the_cap():
    p = proposer(k=8, lo=1, hi=1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    a1, a2, b1 = (decoding(tokens, rid, max_tokens=100) for rid in ("a1", "a2", "b1"))
    a1.tenant = a2.tenant = "A"
    b1.tenant = "B"
    p.start_step([a1, b1, a2])
    # Budget 6: a1 leaves 2 tokens (b1, a2) -> 1 + 3 drafts; its share 4 leaves 1 (a2) -> 1 + 2.
    assert p.propose_within(a1, 6) == [2, 3, 4]
    assert p.propose_within(a1, 6, share=4) == [2, 3]
    assert p.propose_within(b1, 6) == [2, 3, 4, 5]  # b1 leaves a2 one of the budget
    assert p.propose_within(b1, 6, share=4) == [2, 3, 4]  # and none of B's share
    assert p.propose_within(a2, 3, share=2) == [2]  # the last one takes what is left
    assert p.propose_within(a2, 100, cap=3) == [2, 3]  # 1 + drafts within the chunk cap
