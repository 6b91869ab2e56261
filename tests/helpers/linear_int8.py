"""Checks shared by the 8-bit and K-quant kernel tests."""

from __future__ import annotations

import torch

from prefixserve.model.kernels.build import linear_int8_kernel
from prefixserve.model.quant.weights import Int8Weight, packed_weight


def assert_float32_out_is_the_sums(
    w: Int8Weight, x: torch.Tensor, sums: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """A plain call into an fp32 out (the LM head's logits) writes `sums`, the kernel's documented
    fp32 sums, unrounded, and with `bias` the sums + bias in fp32, the same for a row alone and
    in a batch. Returns the call's out with the bias."""
    codes, scales = packed_weight(w)

    def run(rows: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(rows.shape[0], w.codes.shape[0])
        linear_int8_kernel()(out, rows.contiguous(), codes, scales, b, 0, None, 2)
        return out

    assert torch.equal(run(x, None), sums)
    with_bias = run(x, bias)
    assert torch.equal(with_bias, sums + bias.float())
    for rows in (1, 2, 5):
        assert torch.equal(run(x[rows - 1 : rows], bias), with_bias[rows - 1 : rows])
    return with_bias
