"""bf16 linear weights move into one huge-page arena at load: same values, ties kept, each
tensor once; where the arena cannot be made nothing moves."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model.kernels import hugepages
from prefixserve.model.kernels.hugepages import HUGE_PAGE, huge_page_arena, move_to_huge_pages
from prefixserve.model.layers.linear import Linear


def test_parameters_move_once_keep_their_values_and_their_ties():
    a = torch.nn.Parameter(torch.randn(300, 70).bfloat16(), requires_grad=False)
    b = torch.nn.Parameter(torch.randn(5).bfloat16(), requires_grad=False)
    before = a.detach().clone(), b.detach().clone()
    if not move_to_huge_pages([a, b, a]):
        pytest.skip("no transparent huge pages here (not Linux, or THP off)")
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one arena
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % 64 == 0
    assert b.data_ptr() - a.data_ptr() == -(-a.numel() * 2 // 64) * 64  # `a` listed twice, once


def test_the_arena_is_aligned_and_a_failure_moves_nothing(monkeypatch):
    arena = huge_page_arena(3 * HUGE_PAGE + 5)
    if arena is not None:
        assert arena.data_ptr() % HUGE_PAGE == 0 and arena.numel() == 4 * HUGE_PAGE
    monkeypatch.setattr(hugepages, "huge_page_arena", lambda nbytes: None)
    p = torch.nn.Parameter(torch.ones(4).bfloat16(), requires_grad=False)
    ptr = p.data_ptr()
    assert not move_to_huge_pages([p]) and p.data_ptr() == ptr


def test_a_loaded_bf16_model_streams_its_weights_from_the_arena(default_model_bf16):
    model = default_model_bf16.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if hugepages.huge_page_arena(1) is None:
        pytest.skip("no transparent huge pages here (not Linux, or THP off)")
    if all(m._gemm is not None for m in linears):  # the native GEMM streams its packed weights
        assert len({m._gemm[0].untyped_storage().data_ptr() for m in linears}) == 1
    else:
        assert len({m.weight.untyped_storage().data_ptr() for m in linears}) == 1
        for m in linears:
            assert m._stream[0].data_ptr() == m.weight.data_ptr()  # the kernel reads the arena
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
