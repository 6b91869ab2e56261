"""Llama 3's rope scaling read back from a GGUF file's rope_freqs.weight (gguf_rope.py).

The divisors here are made as llama.cpp's converter makes them: Llama 3's definition of the
scaled frequencies, one divisor per rotary pair (1 above the high-frequency bound, `factor`
below the low one, 1 / ((1 - s) / factor + s) between), in float32. The end-to-end case, a GGUF
file written by llama.cpp's own converter and read by our conversion, is in
tests/bench/test_real_shapes.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.model.loader.gguf_rope import (
    RopeFreqsError,
    divisors_of,
    rope_scaling_from_divisors,
)


def llama_cpp_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, context: int
) -> np.ndarray:
    """rope_freqs.weight as llama.cpp writes it for a "llama3" rope_scaling (float32 values)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            blend = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - blend) / factor + blend))
    return np.asarray(out, dtype=np.float32).astype(np.float64)


# (head_dim, theta, factor): Llama 3.2 1B / 3B, Llama 3.1 8B.
PUBLISHED = [(64, 500000.0, 32.0), (128, 500000.0, 32.0), (128, 500000.0, 8.0)]


@pytest.mark.parametrize("head_dim, theta, factor", PUBLISHED)
def test_the_published_llama3_scalings_come_back_exactly(head_dim, theta, factor):
    divisors = llama_cpp_divisors(head_dim, theta, factor, 1.0, 4.0, 8192)
    scaling = rope_scaling_from_divisors(divisors, head_dim, theta)
    assert scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([64, 128]),
    theta=st.sampled_from([10000.0, 500000.0, 1000000.0]),
    factor=st.sampled_from([2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
    low=st.floats(0.25, 2.0),
    ratio=st.floats(1.5, 8.0),
    context=st.sampled_from([2048, 4096, 8192, 32768]),
)
def test_any_llama3_scaling_gives_back_its_divisors_or_is_refused(
    head_dim, theta, factor, low, ratio, context
):
    """The scaling read back rotates as the file says (its divisors within float32 rounding),
    whatever the original context (the divisors fix only the ratios); refused only where the
    divisors do not fix the scaling: no pair divided by the whole factor (every published Llama
    3 has some), or too few pairs blended to fit and Llama 3's own factors do not fit."""
    divisors = llama_cpp_divisors(head_dim, theta, factor, low, low * ratio, context)
    blended = ((divisors > 1 + 1e-5) & (divisors < factor * (1 - 1e-5))).sum()
    try:
        scaling = rope_scaling_from_divisors(divisors, head_dim, theta)
    except RopeFreqsError:
        assert blended < 2 or not (divisors == factor).any()
        return
    if np.all(divisors == 1.0):
        assert scaling is None
        return
    np.testing.assert_allclose(divisors_of(head_dim, theta, scaling), divisors, rtol=1e-5)


def test_divisors_of_one_scale_nothing():
    assert rope_scaling_from_divisors(np.ones(32), 64, 500000.0) is None


@pytest.mark.parametrize(
    "divisors, match",
    [
        (np.ones(16), "16 values"),  # a rotary dimension of 64 has 32 pairs
        (np.full(32, np.nan), "32 values"),
        (np.linspace(1.0, 0.5, 32), "not above 1"),
        (np.linspace(40.0, 1.0, 32), "blend does not rise"),  # divisors fall with the wavelength
        (np.r_[np.ones(10), np.linspace(1.5, 3.0, 12), np.full(10, 32.0)], "not Llama 3's"),
    ],
    ids=["wrong-count", "not-finite", "no-divisor-above-1", "reversed", "not-llama3"],
)
def test_divisors_that_are_not_llama3s_scaling_are_refused(divisors, match):
    with pytest.raises(RopeFreqsError, match=match):
        rope_scaling_from_divisors(divisors, 64, 500000.0)
