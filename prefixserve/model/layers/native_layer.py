"""One native call per decoder layer (csrc/layer/decoder_layer.cpp) for the steps where Python
between
the kernels shows: every row attends through the paged kernel (decode, verification, chunks over
a cached prefix) and every linear takes the native GEMM.

The native layer calls the kernels the Python layer calls, in the same order with the same
arguments, so a layer's output is the same bits either way (tests/model/test_native_layer.py);
it binds a layer's weights once and takes only the step's tensors. It runs on every CPU kind
with the GEMM's vector tiles (the rotary kernel is PyTorch's bits with or without its AVX512-BF16
loop, so the Python layer's choice between the two changes nothing). Llama-family layers take it,
with q/k norms (Qwen3) and with Gemma 3's (1 + weight) norms and post norms. Where any condition
fails (no vector tiles, LoRA, soft-capping, a chunk on another attention path), the layer runs in
Python."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixserve.model.kernels.build import (
    paged_attention_kernel,
    rms_norm_kernel,
    rope_write_kv_kernel,
)
from prefixserve.model.layers.attention import AttentionMetadata
from prefixserve.model.layers.common import Attention, GatedMLP, RMSNorm
from prefixserve.model.layers.kernel_table import _kernel
from prefixserve.model.layers.linear import Linear


def _packed(linear: Linear) -> tuple | None:
    """(packed weight, out features, bias, next packed weight) of a Linear that takes the native
    GEMM at every row count in every mode, (codes, scales, bias, next weight) of an 8-bit one,
    or None."""
    if linear._int8 is not None and linear.lora is None:
        return (*linear._int8, linear._next_packed)
    if linear._gemm is None or linear._fp32 is not None or linear.lora is not None:
        return None
    packed, out_features, bias = linear._gemm
    return (packed, out_features, bias, linear._next_packed)


def bind_decoder_layer(
    attn: Attention,
    mlp: GatedMLP,
    input_norm: RMSNorm,
    mlp_norm: RMSNorm,
    out_norms: tuple[RMSNorm, RMSNorm] | None = None,
) -> object | None:
    """The native form of a decoder layer made of these blocks (pre-norm, fused qkv, q/k norms
    where `attn` has them, rotary, paged attention, gated MLP, residual adds; `out_norms`: norms
    on attention's and the MLP's outputs before their adds, Gemma 3's), or None where it cannot
    take it."""
    cls = _kernel("decoder_layer")
    linears = [_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    attn_out, mlp_out = out_norms if out_norms is not None else (None, None)
    optional = {
        "q_norm": attn.q_norm,
        "k_norm": attn.k_norm,
        "attn_out_norm": attn_out,
        "mlp_out_norm": mlp_out,
    }
    norms = [input_norm, mlp_norm, *(n for n in optional.values() if n is not None)]
    if (
        cls is None
        or any(p is None for p in linears)
        or (attn.q_norm is None) != (attn.k_norm is None)
        or attn.softcap is not None
        or not mlp.gated_act
        or (isinstance(linears[2][1], int) and linears[2][1] % 64)
        or attn.head_dim % 32
        or any(n.weight.dtype != torch.bfloat16 for n in norms)
        or len({(n.eps, n.offset) for n in norms}) != 1
    ):
        return None
    return cls(
        input_norm.weight.detach(),
        mlp_norm.weight.detach(),
        input_norm.eps,
        *linears,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.scale,
        mlp.gated_act,
        offset=input_norm.offset,
        **{name: n.weight.detach() for name, n in optional.items() if n is not None},
    )


def step_takes_native_layers(groups: Sequence[AttentionMetadata]) -> bool:
    """Whether every row of this step attends through the paged kernel itself (not a stand-in
    such as the portable path), in every KV-cache group, and the kernel table still holds the
    RMSNorm and rotary kernels the native layer calls (tests and benchmarks swap them for the
    PyTorch paths): then the native layer computes what the Python one would."""
    kernel = paged_attention_kernel()
    if (
        kernel is None
        or _kernel("rms_norm") is not rms_norm_kernel()
        or _kernel("rope_kv") is not rope_write_kv_kernel()
    ):
        return False
    return all(
        meta.kernel is not None
        and meta.kernel.fn is kernel
        and meta.decode is None
        and not meta.spans
        for meta in groups
    )
