"""SamplingParams: option combinations that cannot work are refused when the params are built."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams


def test_prompt_logprobs_refuse_an_explicit_cache_read():
    with pytest.raises(ValueError, match="skip_reading_prefix_cache"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert SamplingParams(prompt_logprobs=0).skips_prefix_cache_read
    assert SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=True).skips_prefix_cache_read
