"""The low-rank update of one linear, on every path: the native kernels (bf16, a few rows,
contiguous or gathered rows) and PyTorch (fp32, large groups), each against the same update
computed directly in float64."""

from __future__ import annotations

import pytest
import torch

from prefixserve.lora.adapter import LoRAAdapter, lora_weights
from prefixserve.lora.layers import KERNEL_MAX_ROWS, LoRABatch, LoRALinear
from prefixserve.model.layers import kernel_table as model_layers


def adapter(name: str, rank: int, in_f: int, out_f: int, dtype, seed: int) -> LoRAAdapter:
    """Two slices, like a fused linear's: output columns [0, 70) from A's first `rank` rows,
    [70, out_f) from the next `rank` (zero blocks elsewhere in B)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * rank, in_f, generator=g).to(dtype)
    b = torch.zeros(out_f, 2 * rank, dtype=dtype)
    b[:70, :rank] = torch.randn(70, rank, generator=g).to(dtype)
    b[70:, rank:] = torch.randn(out_f - 70, rank, generator=g).to(dtype)
    weights = lora_weights(a, b, [(0, 0, 70), (70, rank, out_f - 70)])
    return LoRAAdapter(name, None, rank, 1.0, b"", None, (), {(0, "lin"): weights})


def reference(x, out, groups):
    want = out.double().clone()
    for ad, _, index in groups:
        a, b = ad.weights[(0, "lin")].a, ad.weights[(0, "lin")].b
        want[index] += x.double()[index] @ a.double().t() @ b.double().t()
    return want


def test_groups_are_slices_when_contiguous_and_indices_otherwise():
    one, two = object(), object()
    batch = LoRABatch()
    batch.set([(one, 0, 3), (None, 3, 4), (two, 4, 6), (one, 6, 7), (two, 7, 9)])
    (a1, rows1, idx1), (a2, rows2, idx2) = batch.groups
    assert a1 is one and rows1.tolist() == idx1.tolist() == [0, 1, 2, 6]
    assert a2 is two and rows2.tolist() == [4, 5, 7, 8]
    batch.set([(one, 2, 4), (one, 4, 5), (None, 0, 2)])
    ((_, rows, idx),) = batch.groups
    assert rows == slice(2, 5) and idx.tolist() == [2, 3, 4]
    batch.clear()
    assert batch.groups == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, KERNEL_MAX_ROWS + 3])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_update_equals_the_direct_product(dtype, rows, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setitem(model_layers._kernels, "lora_add", None)
    elif model_layers._kernel("lora_add") is None:
        pytest.skip("native kernels unavailable")
    in_f, out_f = 96, 200  # not multiples of the vector widths: the kernels' tails run
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2 * rows + 1, in_f, generator=g).to(dtype)
    out = torch.randn(2 * rows + 1, out_f, generator=g).to(dtype)
    batch = LoRABatch()
    first, second = adapter("a", 8, in_f, out_f, dtype, 1), adapter("b", 3, in_f, out_f, dtype, 2)
    # "a": rows 0..rows-1 (a slice); "b": every other row after it (gathered)
    segments = [(first, 0, rows)] + [
        (second if i % 2 else None, rows + i, rows + i + 1) for i in range(rows + 1)
    ]
    batch.set(segments)
    want = reference(x, out, batch.groups)
    LoRALinear(batch, (0, "lin")).apply(x, out)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    scale = want.abs().max()
    assert (out.double() - want).abs().max() <= tol * scale
    # rows of no adapter are untouched
    base_rows = [rows + i for i in range(rows + 1) if i % 2 == 0]
    assert torch.equal(out.double()[base_rows], want[base_rows])
