"""Rotary position embedding: the cos/sin tables of a step's positions and the rotation.

Neox-style (rotate-half) with the sign folded into the sin table, so the rotation is
`x * cos + roll(x, D/2) * sin`; `kernels.rope_write_kv` computes the same, bit for bit, fused with
the K/V writes (layers.Attention)."""

from __future__ import annotations

import math

import torch


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate-half), cos/sin computed for the step's positions."""

    def __init__(self, head_dim: int, base: float, scaling: dict | None = None) -> None:
        inv_freq = 1.0 / (
            base
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        )
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sign-folded sin `[num_tokens, 1, head_dim]` in `dtype` for `apply_rotary`:
        `[cos, cos]` and `[-sin, sin]` over the two halves of the head.

        Rows come from a table of every position so far (grown by doubling), computed with the
        same ops as a per-step computation would be, so the values are identical."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * table[0].shape[0] if table is not None else 1024)
            freqs = torch.arange(size).float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            table = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
            self._tables[dtype] = table
        return (
            table[0].index_select(0, positions).unsqueeze(1),
            table[1].index_select(0, positions).unsqueeze(1),
        )


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low_freq_factor
        high_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `[num_tokens, num_heads, head_dim]` by `RotaryEmbedding.cos_sin` tables.

    x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the sign lives in the sin
    table, so the half swap is a roll (same roundings as transformers, fewer ops)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
