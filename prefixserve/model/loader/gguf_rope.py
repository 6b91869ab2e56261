"""Llama 3's RoPE scaling, read back from a GGUF file's `rope_freqs.weight`.

Llama 3.1 and later scale their rotary frequencies (`rope_scaling` of type "llama3": a `factor`
for the low frequencies, none for the high ones, a smooth blend between, set by
`low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`). llama.cpp's
converter does not write those four numbers into the GGUF metadata: it writes their result, one
divisor per rotary pair, as the tensor `rope_freqs.weight` (1 for the high frequencies, `factor`
for the low ones), and its kernels divide each pair's frequency by it. transformers' GGUF loader
drops that tensor, so a converted Llama 3.2 would rotate unscaled, with other logits than the
checkpoint's and llama.cpp's.

`rope_scaling_from_gguf` turns the divisors back into the rope_scaling a Hugging Face config
carries (which transformers and `RotaryEmbedding` read): `factor` is the largest divisor (some
pairs are divided by the whole factor in every published Llama 3); the
blend is linear in 1 / wavelength, so two or more blended pairs give it exactly, and
`original_max_position_embeddings` is Llama 3's 8192 (the divisors fix only the ratios of the
three, and a blend's wavelength bounds are the same for any choice). Where no pair is blended,
Llama 3's own factors (1 and 4) are taken. The result is checked: `RotaryEmbedding`'s scaled
frequencies must give the file's divisors (within float32 rounding), else the file is refused
(`ModelLoadError`) rather than served with rotations llama.cpp would not make.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from prefixserve.model.layers.rotary import RotaryEmbedding

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Llama 3's: the divisors fix only their ratios (module docstring).
LLAMA3_ORIGINAL_CONTEXT = 8192
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0
# How close RotaryEmbedding's divisors must come to the file's (float32 values, computed in
# float32 by llama.cpp's converter and here).
RTOL = 1e-5


class RopeFreqsError(ValueError):
    """A `rope_freqs.weight` that is not Llama 3's scaling."""


def rope_freqs_of(reader: Any) -> np.ndarray | None:
    """The file's rotary divisors (float64), or None where it has none."""
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    return None


def divisors_of(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Each rotary pair's frequency divided by its frequency under `scaling`, as
    `RotaryEmbedding` computes them."""
    plain = RotaryEmbedding(head_dim, theta).inv_freq.double()
    scaled = RotaryEmbedding(head_dim, theta, scaling).inv_freq.double()
    return (plain / scaled).numpy()


def rope_scaling_from_divisors(divisors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """The "llama3" rope_scaling whose divisors are `divisors` (None where every one is 1);
    RopeFreqsError where none is."""
    if divisors.shape != (head_dim // 2,) or not np.all(np.isfinite(divisors)):
        raise RopeFreqsError(
            f"{ROPE_FREQS_TENSOR} has {divisors.size} values; the rotary dimension "
            f"{head_dim} has {head_dim // 2} pairs"
        )
    if np.allclose(divisors, 1.0, rtol=RTOL, atol=0):
        return None
    factor = float(np.float32(divisors.max()))
    for low, high in _blend_bounds(divisors, factor, head_dim, theta):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
        }
        if np.allclose(divisors_of(head_dim, theta, scaling), divisors, rtol=RTOL, atol=0):
            return scaling
    raise RopeFreqsError(
        f"{ROPE_FREQS_TENSOR} is not Llama 3's rope scaling (factor {factor:g}; no low and high "
        "frequency factors give its divisors)"
    )


def _blend_bounds(
    divisors: np.ndarray, factor: float, head_dim: int, theta: float
) -> list[tuple[float, float]]:
    """Candidate (low_freq_factor, high_freq_factor) pairs of the blend for
    LLAMA3_ORIGINAL_CONTEXT, the likeliest first: where two or more pairs are blended, the fit
    rounded to three decimals (as configs write them: 1 and 4), then as fitted; else Llama 3's."""
    if factor <= 1.0:
        raise RopeFreqsError(f"{ROPE_FREQS_TENSOR}'s largest divisor is {factor:g}, not above 1")
    blended = (divisors > 1.0 + RTOL) & (divisors < factor * (1.0 - RTOL))
    if blended.sum() < 2:
        return [(LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR)]
    # A blended pair's divisor d is 1 / ((1 - s) / factor + s), with the blend s linear in the
    # inverse wavelength: s = context / wavelength / (high - low) - low / (high - low).
    inv_freq = RotaryEmbedding(head_dim, theta).inv_freq.double().numpy()
    inv_wavelength = inv_freq[blended] / (2 * math.pi)
    blend = (1.0 / divisors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv_wavelength, blend, 1)
    if slope <= 0:
        raise RopeFreqsError(f"{ROPE_FREQS_TENSOR}'s blend does not rise with the frequency")
    width = LLAMA3_ORIGINAL_CONTEXT / slope
    low = float(-intercept * width)
    return [(round(low, 3), round(low + width, 3)), (low, low + width)]


def rope_scaling_from_gguf(reader: Any, head_dim: int, theta: float) -> dict | None:
    """The rope_scaling of a GGUF file whose `rope_freqs.weight` scales its rotary frequencies
    (read by `reader`, a gguf.GGUFReader), or None where it has no such tensor or scales
    nothing. RopeFreqsError where the divisors are not Llama 3's scaling."""
    divisors = rope_freqs_of(reader)
    if divisors is None:
        return None
    return rope_scaling_from_divisors(divisors, head_dim, theta)
