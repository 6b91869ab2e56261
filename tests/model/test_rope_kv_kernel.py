"""The fused rotary + K/V write of decode-sized steps: bit for bit PyTorch's rotary and
index copies, in both dtypes, so that a prompt's K computed by one path in one run and by the
other in another agree exactly (the float32 equality of cached and recomputed outputs)."""

import pytest
import torch

from prefixserve.model.kernels.build import rope_write_kv_kernel
from prefixserve.model.layers.attention import write_kv
from prefixserve.model.layers.rotary import RotaryEmbedding, apply_rotary

kernel = rope_write_kv_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the kernels could not be built here")
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def case(tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0).cos_sin(positions, dtype)
    caches = [torch.zeros(40, 16, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(40 * 16, generator=g)[:tokens]
    return qkv, cos, sin, caches, slots


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 4, 9, 70, 300])
def test_rotary_and_kv_writes_are_bit_for_bit_pytorchs(dtype, tokens):
    qkv, cos, sin, (kc, vc), slots = case(tokens, dtype)
    width = (Q_HEADS + KV_HEADS) * HEAD_DIM
    want = apply_rotary(qkv[:, :width].view(tokens, -1, HEAD_DIM), cos, sin)
    want_kc, want_vc = kc.clone(), vc.clone()
    v = qkv[:, width:].view(tokens, KV_HEADS, HEAD_DIM)
    write_kv(want_kc, want_vc, want[:, Q_HEADS:], v, slots)

    got = qkv.clone()
    kernel(got, cos.view(tokens, -1), sin.view(tokens, -1), Q_HEADS, KV_HEADS, kc, vc, slots)
    assert torch.equal(got[:, :width].view(tokens, -1, HEAD_DIM), want)
    assert torch.equal(got[:, width:], qkv[:, width:])  # v is not rotated
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    qkv, cos, sin, (kc, vc), slots = case(2, torch.bfloat16)
    slots[1] = kc.shape[0] * kc.shape[1]
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="not in the cache"):
        kernel(qkv, cos.view(2, -1), sin.view(2, -1), Q_HEADS, KV_HEADS, kc, vc, slots)
    assert torch.equal(qkv, before) and not kc.any() and not vc.any()
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(qkv.float(), cos.view(2, -1), sin.view(2, -1), Q_HEADS, KV_HEADS, kc, vc, slots)


def test_every_bf16_step_takes_the_kernel_only_where_its_vector_loop_was_built(monkeypatch):
    from prefixserve.model.layers import common as layers

    for vectorized, bf16_64, bf16_48, fp32_64 in ((True, 1 << 62, 4, 4), (False, 4, 4, 4)):
        layers.rope_kv_max_tokens.cache_clear()
        monkeypatch.setattr(layers, "rope_kv_vectorized", lambda v=vectorized: v)
        assert layers.rope_kv_max_tokens(torch.bfloat16, 64) == bf16_64
        assert layers.rope_kv_max_tokens(torch.bfloat16, 48) == bf16_48  # no multiple of 32
        assert layers.rope_kv_max_tokens(torch.float32, 64) == fp32_64  # the scalar loop
    layers.rope_kv_max_tokens.cache_clear()
