"""SamplingParams: option combinations that cannot work are refused when the params are built."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams


def test_prompt_logprobs_refuse_an_explicit_cache_read():
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert SamplingParams(prompt_logprobs=0).skips_prefix_cache_read
    assert SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=True).skips_prefix_cache_read


NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", 100.5),
    ("temperature", -0.1),
    ("top_p", NAN),
    ("top_p", 0.0),
    ("min_p", NAN),
    ("presence_penalty", NAN),
    ("frequency_penalty", -INF),
    ("repetition_penalty", 1e-38),
    ("repetition_penalty", NAN),
    ("repetition_penalty", 101.0),
    ("top_k", 2**31),
    ("seed", -1),
    ("seed", 2**64),
    ("stop", ["x" * 1025]),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", list(range(1025))),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_every_bound_is_checked_and_nan_never_passes(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_the_seed_of_every_child_fits_64_bits():
    SamplingParams(seed=2**64 - 2, n=2)
    SamplingParams(seed=2**64 - 1, n=1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 1, n=2)


def test_the_bounds_at_their_edges_are_accepted():
    SamplingParams(
        temperature=100.0,
        repetition_penalty=0.01,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        top_p=1.0,
        min_p=1.0,
        top_k=2**31 - 1,
        stop=["x" * 1024],
        stop_token_ids=[2**31 - 1] * 1024,
    )
    SamplingParams(repetition_penalty=100.0, temperature=0.0)
