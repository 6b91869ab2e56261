"""Sampling rules, one test per rule, on small hand-made distributions."""

import math
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.sample.sampler import (
    Sampler,
    compute_prompt_logprobs,
    sampling_distribution,
)

# A fixed distribution over 6 tokens: probabilities 0.4, 0.3, 0.15, 0.1, 0.05, 0.0 (=-inf).
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
LOGITS = PROBS.log()


def req(prompt=(7,), output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params))
    if output:
        r.append_output_token_ids(list(output))
    return r


def sample(logits, requests, generators=None):
    if logits.dim() == 1:
        logits = logits.expand(len(requests), -1).clone()
    generators = generators or [torch.Generator().manual_seed(i) for i in range(len(requests))]
    return Sampler()(logits, requests, generators)


def draw_many(params: dict, n: int = 2000, logits=LOGITS, seed: int = 0) -> Counter:
    """n draws from the same distribution (one batch of n rows sharing a generator)."""
    gen = torch.Generator().manual_seed(seed)
    requests = [req(**params) for _ in range(n)]
    out = Sampler()(logits.expand(n, -1).clone(), requests, [gen] * n)
    return Counter(t for t, _ in out)


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [req(temperature=0.0) for _ in range(5)])
    assert [t for t, _ in out] == logits.argmax(-1).tolist()
    assert all(lp is None for _, lp in out)


def test_tiny_temperature_is_greedy():
    out = sample(LOGITS, [req(temperature=1e-7) for _ in range(20)])
    assert {t for t, _ in out} == {0}


def test_greedy_ignores_top_k_top_p_min_p():
    out = sample(LOGITS, [req(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)])
    assert out[0][0] == 0


def test_sampler_never_modifies_the_callers_logits():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    sample(
        logits,
        [
            req(output=[1, 2], temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
            req(temperature=0.7, top_k=3, logprobs=2),
            req(temperature=0.0),
        ],
    )
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_accepted():
    out = sample(LOGITS.to(torch.bfloat16), [req(temperature=0.0, logprobs=1)])
    assert out[0][0] == 0 and out[0][1][0][0] == 0


def test_rows_must_match_requests_and_generators():
    with pytest.raises(ValueError, match="one request and generator per row"):
        Sampler()(torch.zeros(2, 4), [req()], [None])


# --- random sampling ------------------------------------------------------------------------------


def test_temperature_one_draws_from_the_model_distribution():
    counts = draw_many({"temperature": 1.0}, n=4000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)
    assert counts[5] == 0  # probability 0 is never drawn


def test_temperature_divides_the_logits():
    r = [req(temperature=0.5), req(temperature=2.0)]
    probs = sampling_distribution(LOGITS[:5].expand(2, -1), r)
    assert torch.allclose(probs[0], torch.softmax(LOGITS[:5] / 0.5, -1))
    assert torch.allclose(probs[1], torch.softmax(LOGITS[:5] / 2.0, -1))


def test_top_k_keeps_only_k_tokens():
    counts = draw_many({"temperature": 1.0, "top_k": 2})
    assert set(counts) == {0, 1}
    # Renormalized over the two: 0.4 / 0.7 and 0.3 / 0.7.
    assert abs(counts[0] / 2000 - 0.4 / 0.7) < 0.04


def test_top_k_one_is_greedy():
    assert set(draw_many({"temperature": 1.5, "top_k": 1})) == {0}


@pytest.mark.parametrize("top_k", [0, -1, 6, 100])
def test_top_k_disabled_or_larger_than_vocab_keeps_everything(top_k):
    probs = sampling_distribution(LOGITS.unsqueeze(0), [req(top_k=top_k)])
    assert torch.allclose(probs[0], PROBS)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.35, {0}), (0.5, {0, 1}), (0.69, {0, 1}), (0.71, {0, 1, 2}), (0.9, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = sampling_distribution(LOGITS.unsqueeze(0), [req(top_p=top_p)])[0]
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == kept
    expected = torch.zeros(6)
    expected[list(kept)] = PROBS[list(kept)] / PROBS[list(kept)].sum()
    assert torch.allclose(probs, expected, atol=1e-6)


def test_top_p_always_keeps_the_most_likely_token():
    assert set(draw_many({"temperature": 1.0, "top_p": 1e-6})) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # min_p 0.5 of the top 0.4 = 0.2: only 0.4 and 0.3 survive.
    probs = sampling_distribution(LOGITS.unsqueeze(0), [req(min_p=0.5)])[0]
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == {0, 1}
    assert set(draw_many({"temperature": 1.0, "min_p": 0.5})) == {0, 1}


def test_top_k_and_top_p_combine():
    # top_k 3 leaves 0.4, 0.3, 0.15 (renormalized 0.47, 0.35, 0.18); top_p 0.8 then drops the last.
    probs = sampling_distribution(LOGITS.unsqueeze(0), [req(top_k=3, top_p=0.8)])[0]
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == {0, 1}


def test_each_row_uses_its_own_parameters():
    rows = [req(temperature=1.0, top_k=1), req(temperature=1.0), req(temperature=0.0)]
    probs = sampling_distribution(LOGITS.expand(2, -1), rows[:2])
    assert probs[0].tolist() == [1.0, 0, 0, 0, 0, 0]
    assert torch.allclose(probs[1], PROBS)


# --- seeds ----------------------------------------------------------------------------------------


def _seeded_run(seed: int, neighbours: int) -> list[int]:
    """20 steps of one seeded row, batched with `neighbours` unseeded rows."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(1234)
    tokens = []
    for _ in range(20):
        requests = [req(temperature=1.0, seed=seed)] + [req(temperature=1.0)] * neighbours
        out = Sampler()(
            LOGITS.expand(len(requests), -1).clone(), requests, [gen] + [shared] * neighbours
        )
        tokens.append(out[0][0])
    return tokens


def test_same_seed_same_tokens():
    assert _seeded_run(7, 0) == _seeded_run(7, 0)


def test_same_seed_same_tokens_whatever_the_batch():
    assert _seeded_run(7, 0) == _seeded_run(7, 5)


def test_different_seeds_give_different_tokens():
    assert _seeded_run(7, 0) != _seeded_run(8, 0)


# --- penalties ------------------------------------------------------------------------------------


def test_presence_penalty_subtracts_once_per_generated_token():
    logits = torch.zeros(6)
    r = req(prompt=[3], output=[1, 1, 2], temperature=0.0, presence_penalty=0.5, logprobs=6)
    entry = sample(logits, [r])[0][1]
    lp = {t: v for t, v, _ in entry[1:]}
    # Tokens 1 and 2 lose 0.5 each; prompt token 3 is not penalized.
    assert math.isclose(lp[1] - lp[0], -0.5, abs_tol=1e-5)
    assert math.isclose(lp[2] - lp[0], -0.5, abs_tol=1e-5)
    assert math.isclose(lp[3] - lp[0], 0.0, abs_tol=1e-5)


def test_frequency_penalty_scales_with_the_count():
    logits = torch.zeros(6)
    r = req(prompt=[3], output=[1, 1, 2], temperature=0.0, frequency_penalty=0.5, logprobs=6)
    lp = {t: v for t, v, _ in sample(logits, [r])[0][1][1:]}
    assert math.isclose(lp[1] - lp[0], -1.0, abs_tol=1e-5)
    assert math.isclose(lp[2] - lp[0], -0.5, abs_tol=1e-5)
    assert math.isclose(lp[3] - lp[0], 0.0, abs_tol=1e-5)


def test_negative_presence_penalty_encourages_repeats():
    r = req(output=[3], temperature=0.0, presence_penalty=-2.0)
    assert sample(LOGITS, [r])[0][0] == 3  # log 0.1 + 2 > log 0.4


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0])
    r = req(prompt=[0, 1], output=[5], temperature=0.0, repetition_penalty=2.0, logprobs=6)
    lp = {t: v for t, v, _ in sample(logits, [r])[0][1][1:]}
    processor = RepetitionPenaltyLogitsProcessor(2.0)
    expected = processor(torch.tensor([[0, 1, 5]]), logits.unsqueeze(0).clone())[0]
    # Positive logits divided, negative multiplied, over prompt and output alike.
    assert torch.allclose(expected, torch.tensor([1.0, -2.0, 0.5, -0.5, 1.0, 1.5]))
    expected_lp = torch.log_softmax(expected, -1)
    assert all(math.isclose(lp[t], expected_lp[t].item(), abs_tol=1e-5) for t in range(6))


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([2.0, 1.9, 0.0])
    r = req(prompt=[0], temperature=0.0, repetition_penalty=1.2)
    assert sample(logits, [r])[0][0] == 1


def test_penalties_apply_per_row():
    logits = torch.tensor([1.0, 0.9, 0.0]).expand(2, -1).clone()
    rows = [
        req(output=[0], temperature=0.0, presence_penalty=1.0),
        req(output=[0], temperature=0.0),
    ]
    assert [t for t, _ in sample(logits, rows)] == [1, 0]


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_give_chosen_first_then_top_n_with_ranks():
    out = sample(LOGITS, [req(temperature=0.0, logprobs=3)])
    token, entry = out[0]
    assert token == 0
    expected = PROBS.log()
    assert entry[0][0] == 0 and entry[0][2] == 1
    assert [(t, r) for t, _, r in entry[1:]] == [(0, 1), (1, 2), (2, 3)]
    for t, v, _ in entry:
        assert math.isclose(v, expected[t].item(), abs_tol=1e-5)


def test_logprobs_zero_gives_only_the_chosen_token():
    out = sample(LOGITS, [req(temperature=0.0, logprobs=0)])
    assert len(out[0][1]) == 1 and out[0][1][0][0] == 0


def test_rank_of_a_sampled_unlikely_token():
    logits = torch.tensor([5.0, 4.0, 3.0, -100.0])
    out = sample(
        logits, [req(output=[0, 1, 2], presence_penalty=-2.0, temperature=0.0, logprobs=1)]
    )
    # Penalties move token 0 to 7, 1 to 6, 2 to 5: greedy 0, rank 1.
    assert out[0][1][0][2] == 1
    out = sample(LOGITS, [req(temperature=1.0, top_k=0, logprobs=1)] * 200)
    for token, entry in out:
        assert entry[0][0] == token and entry[0][2] == token + 1  # PROBS are sorted


def test_logprobs_are_before_temperature_and_top_k():
    out = sample(LOGITS, [req(temperature=0.3, top_k=2, logprobs=5)])
    expected = PROBS.log()
    for t, v, _ in out[0][1]:
        assert math.isclose(v, expected[t].item(), abs_tol=1e-5)


def test_logprobs_only_for_rows_that_ask():
    out = sample(LOGITS, [req(temperature=0.0, logprobs=2), req(temperature=0.0)])
    assert out[0][1] is not None and out[1][1] is None


def test_compute_prompt_logprobs_scores_each_target():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(3))
    targets = [3, 1, 4, 1]
    entries = compute_prompt_logprobs(logits, targets, 2)
    lp = torch.log_softmax(logits, -1)
    for row, (entry, target) in enumerate(zip(entries, targets, strict=True)):
        assert entry[0][0] == target
        assert math.isclose(entry[0][1], lp[row, target].item(), abs_tol=1e-5)
        assert entry[0][2] == int((lp[row] > lp[row, target]).sum()) + 1
        assert [t for t, _, _ in entry[1:]] == lp[row].topk(2).indices.tolist()


def test_compute_prompt_logprobs_needs_one_target_per_row():
    with pytest.raises(ValueError, match="one target id per logits row"):
        compute_prompt_logprobs(torch.zeros(2, 5), [1], 0)


def _dense_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p by a full sort, written the plain way."""
    logits = logits / p.temperature
    probs = torch.softmax(logits, -1)
    if p.min_p > 0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    order = logits.argsort(descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    k = p.top_k if 0 < p.top_k < logits.numel() else logits.numel()
    keep[order[:k]] = True
    logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        mass = 0.0
        for token in order.tolist():
            if mass >= p.top_p:
                probs[token] = 0.0
            mass += probs[token].item() if mass < p.top_p else 0.0
    return probs / probs.sum()


CASES = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_k": 300},  # more than the 256 candidates
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 5.0, "top_p": 0.95},  # flat: the nucleus is wider than 256 candidates
    {"temperature": 1.0, "top_k": 40, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.05, "top_p": 0.9},
]


def test_every_filter_combination_matches_a_plain_full_sort_reference():
    logits = 2.0 * torch.randn(len(CASES), 1000, generator=torch.Generator().manual_seed(5))
    requests = [req(**case) for case in CASES]
    ours = sampling_distribution(logits, requests)  # all rows in one batch
    for row, r in enumerate(requests):
        expected = _dense_reference(logits[row], r.sampling_params)
        assert torch.allclose(ours[row], expected, atol=1e-5), CASES[row]
        assert (ours[row] > 0).sum() == (expected > 0).sum(), CASES[row]


def test_flat_distribution_top_p_keeps_the_whole_nucleus():
    # 1000 equal tokens: top_p 0.5005 keeps 501 of them, far beyond the candidate window.
    probs = sampling_distribution(torch.zeros(1, 1000), [req(top_p=0.5005)])[0]
    assert int((probs > 0).sum()) == 501
    assert math.isclose(probs.sum().item(), 1.0, abs_tol=1e-5)


def test_draws_only_tokens_with_mass():
    logits = torch.full((1, 1000), float("-inf"))
    logits[0, [3, 500, 999]] = torch.tensor([0.0, 1.0, 2.0])
    counts = draw_many({"temperature": 1.0}, n=500, logits=logits[0])
    assert set(counts) <= {3, 500, 999} and len(counts) == 3


def test_penalties_work_on_bfloat16_and_non_contiguous_logits():
    base = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]]).t().contiguous().t()  # column-major
    assert not base.is_contiguous()
    rows = [req(prompt=[0], temperature=0.0, repetition_penalty=1.2)] * 2
    assert [t for t, _ in sample(base, rows)] == [1, 1]
    assert [t for t, _ in sample(base.to(torch.bfloat16), rows)] == [1, 1]


def test_every_logprob_given_back_is_finite_minus_inf_becomes_minus_9999():
    [(token, logprobs)] = sample(LOGITS, [req(temperature=0.0, logprobs=6)])
    values = [lp for _, lp, _ in logprobs]
    assert all(math.isfinite(v) for v in values)
    assert values[-1] == -9999.0  # token 5 has probability 0
    [entries] = compute_prompt_logprobs(LOGITS.unsqueeze(0), [5], 2)
    assert entries[0][1] == -9999.0


def test_a_nan_logprob_is_an_error_not_a_value():
    logits = LOGITS.clone()
    logits[2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sample(logits, [req(temperature=0.0, logprobs=2)])


def test_penalties_that_overflow_the_logits_are_an_error():
    logits = torch.tensor([5.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="non-finite"):
        sample(logits, [_forced_penalty(req(prompt=(0,)), 1e-38)])


def _forced_penalty(request: Request, penalty: float) -> Request:
    object.__setattr__(request.sampling_params, "repetition_penalty", penalty)
    return request
