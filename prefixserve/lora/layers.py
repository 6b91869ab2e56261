"""Batched low-rank updates on our linears: one step mixes requests of several adapters and of
the base model, as punica and S-LoRA batch them, in plain PyTorch.

`LoRABatch` says, for the step being run, which rows of the flat token batch run under which
adapter: one group per adapter, its rows as a slice when they are contiguous (the common case:
a request's rows are consecutive, and one adapter's requests often are too) or as an index
tensor otherwise. `batch_of` gives each target linear of a model a `LoRALinear`, which adds
`(x[rows] @ A.T) @ B.T` for every group whose adapter has weights for that linear (`Linear.forward`
calls it after the base matmul). With no group (no adapter in the step) the cost is one check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from prefixserve.lora.adapter import LoRAAdapter

TARGET_LINEARS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}

Rows = slice | torch.Tensor


class LoRABatch:
    """The current step's groups: `(adapter, rows)`, empty outside a step or with no adapter."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAAdapter, Rows]] = []

    def set(self, segments: Sequence[tuple[LoRAAdapter | None, int, int]]) -> None:
        """Group the step's `(adapter or None, first row, end row)` segments by adapter."""
        spans: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        for adapter, start, end in segments:
            if adapter is not None and end > start:
                spans.setdefault(id(adapter), (adapter, []))[1].append((start, end))
        groups: list[tuple[LoRAAdapter, Rows]] = []
        for adapter, ranges in spans.values():
            ranges.sort()
            merged = [list(ranges[0])]
            for start, end in ranges[1:]:
                if start == merged[-1][1]:
                    merged[-1][1] = end
                else:
                    merged.append([start, end])
            if len(merged) == 1:
                groups.append((adapter, slice(merged[0][0], merged[0][1])))
            else:
                rows = [r for start, end in merged for r in range(start, end)]
                groups.append((adapter, torch.tensor(rows, dtype=torch.int64)))
        self.groups = groups

    def clear(self) -> None:
        self.groups = []


class LoRALinear:
    """The low-rank update of one linear (`key` = (layer index, linear name))."""

    __slots__ = ("batch", "key")

    def __init__(self, batch: LoRABatch, key: tuple[int, str]) -> None:
        self.batch = batch
        self.key = key

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every adapter's update to its rows of `out` (the base linear's output of `x`)."""
        for adapter, rows in self.batch.groups:
            pair = adapter.weights.get(self.key)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                out[rows].addmm_(torch.mm(x[rows], a.t()), b.t())
            else:
                update = torch.mm(torch.mm(x.index_select(0, rows), a.t()), b.t())
                out.index_add_(0, rows, update)


def batch_of(model: nn.Module) -> LoRABatch:
    """The model's LoRABatch, attaching a LoRALinear to every target linear of its decoder
    layers on first use. One per model: engines that share a loaded model share it (each sets
    its groups for its own step and clears them after)."""
    batch = getattr(model, "lora_batch", None)
    if batch is None:
        batch = LoRABatch()
        for index, layer in enumerate(model.model.layers):
            for block_name, linears in TARGET_LINEARS.items():
                block = getattr(layer, block_name)
                for name in linears:
                    getattr(block, name).lora = LoRALinear(batch, (index, name))
        model.lora_batch = batch
    return batch
