"""Batched low-rank updates on our linears: one step mixes requests of several adapters and of
the base model, as punica and S-LoRA batch them: native kernels for a few bf16 rows, PyTorch
matmuls otherwise.

`LoRABatch` says, for the step being run, which rows of the flat token batch run under which
adapter: one group per adapter, its rows as a slice when they are contiguous (the common case:
a request's rows are consecutive, and one adapter's requests often are too) or as an index
tensor otherwise. `batch_of` gives each target linear of a model a `LoRALinear`, which adds
`(x[rows] @ A.T) @ B.T` for every group whose adapter has weights for that linear (`Linear.forward`
calls it after the base matmul). With no group (no adapter in the step) the cost is one check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from prefixserve.lora.adapter import LoRAAdapter
from prefixserve.model.layers.kernel_table import compiled_kernel
from prefixserve.model.layers.linear import linears_batch_invariant

TARGET_LINEARS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}

# bf16 groups of at most this many rows take the native kernel (`compiled_kernel("lora_add")`,
# csrc/linear/lora.cpp) for both products and the add, in one call and no PyTorch op: oneDNN's bf16
# matmul costs the same setup a call at these shapes whatever the rows (AMD Zen 5, one thread,
# [1-16, 576] x [576, 48]), and each PyTorch op of a multi-row step can wake OpenMP's sleeping
# threads; through them, one adapter on every projection made the base model's decode step much
# slower at batch 1 and at batch 16 (BENCHMARKS.md, "LoRA adapters: step cost, and W1 over 4
# adapters against vLLM"; `benchmarks/bench_lora.py`). Larger groups (prefill chunks) amortize
# the matmuls' setup and keep PyTorch, as fp32 models do: the kernel for every group made a
# W1-shaped run over 4 adapters slower (same entry: alternating runs, `LLM.generate` of 32
# prompts of 1,088 tokens). In batch-invariant runs
# every bf16 group takes the kernel, whose sums for a row do not depend on the other rows (each
# row's own FMA chains, 4 rows sharing only the weight loads), so a row's update is the same
# in a decode step as in a prompt of any length.
KERNEL_MAX_ROWS = 64

Rows = slice | torch.Tensor


class LoRABatch:
    """The current step's groups: `(adapter, rows, row indices)` (rows a slice when they are
    contiguous, else the index tensor); empty outside a step or with no adapter."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAAdapter, Rows, torch.Tensor]] = []

    def set(self, segments: Sequence[tuple[LoRAAdapter | None, int, int]]) -> None:
        """Group the step's `(adapter or None, first row, end row)` segments by adapter."""
        spans: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        for adapter, start, end in segments:
            if adapter is not None and end > start:
                spans.setdefault(id(adapter), (adapter, []))[1].append((start, end))
        groups: list[tuple[LoRAAdapter, Rows, torch.Tensor]] = []
        for adapter, ranges in spans.values():
            ranges.sort()
            merged = [list(ranges[0])]
            for start, end in ranges[1:]:
                if start == merged[-1][1]:
                    merged[-1][1] = end
                else:
                    merged.append([start, end])
            index = torch.tensor(
                [r for start, end in merged for r in range(start, end)], dtype=torch.int64
            )
            rows = slice(merged[0][0], merged[0][1]) if len(merged) == 1 else index
            groups.append((adapter, rows, index))
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
        kernel = None
        invariant = linears_batch_invariant()
        if invariant and x.dtype == torch.bfloat16:
            x = x.contiguous()
        if x.dtype == torch.bfloat16 and x.is_contiguous() and out.is_contiguous():
            kernel = compiled_kernel("lora_add")
        max_rows = sys.maxsize if invariant else KERNEL_MAX_ROWS
        for adapter, rows, index in self.batch.groups:
            weights = adapter.weights.get(self.key)
            if weights is None:
                continue
            a, b = weights.a, weights.b
            if kernel is not None and index.shape[0] <= max_rows:
                kernel(out, x, a, weights.blocks, weights.meta, index)
            elif isinstance(rows, slice):
                out[rows].addmm_(torch.mm(x[rows], a.t()), b.t())
            else:
                update = torch.mm(torch.mm(x.index_select(0, rows), a.t()), b.t())
                out.index_add_(0, rows, update)


def batch_of(model: nn.Module) -> LoRABatch:
    """The model's LoRABatch, attaching a LoRALinear to every target linear of its decoder
    layers on first use. One per model: engines that share a loaded model share it (each sets
    its groups for its own step and clears them after), so their steps must not overlap in
    time, which holds for engines stepped by one thread (tests, benchmarks) and for the server
    (one engine)."""
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
