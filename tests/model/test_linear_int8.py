"""8-bit weights (model/quant/weights.py, csrc/linear/linear_int8.cpp, model/loader/quantize.py).

The kernel is pinned twice: to a float64 reference of its quantized operands (within bf16's
rounding), and bit for bit to a Python model of its one summation order (exact integer lane sums,
one fused multiply-add a lane and span, the fixed reduction tree), which every CPU family's
build must match. A row's bits do not depend on the batch, the epilogues round as gemm_bf16's,
Q8_0 blocks come back exactly from a GGUF file's values, and an engine over 8-bit weights gives
a cache hit the cold start's bits, with the native decoder layer or without it. Q4_0's and Q5_0's
codes, read in 4 and 5 bits, give the bits their 8-bit codes give.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prefixserve.config import EngineConfig
from prefixserve.engine_args import EngineArgs
from prefixserve.llm import LLM
from prefixserve.model.kernels.build import linear_int8_kernel
from prefixserve.model.layers.linear import Linear
from prefixserve.model.loader import quantize as quantize_module
from prefixserve.model.quant.weights import (
    LOW_BIT_FORMATS,
    SPAN_ORDER,
    Int8Weight,
    fuse,
    pack_codes,
    packed_weight,
    quantize_per_channel,
    quantize_q4_k,
    recover_gguf_blocks,
    weights_numerics,
)
from prefixserve.sampling_params import SamplingParams
from tests.helpers.linear_int8 import assert_float32_out_is_the_sums

pytestmark = pytest.mark.skipif(linear_int8_kernel() is None, reason="kernels not built")


def _run(x, w: Int8Weight, bias=None, act=0, residual=None):
    n = w.codes.shape[0] // (2 if act else 1)
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    codes, scales = packed_weight(w)
    linear_int8_kernel()(out, x, codes, scales, bias, act, residual, 2)
    return out


def _run_8_bit(x, w: Int8Weight):
    """The same weight's codes in 8 bits, whatever its format."""
    out = torch.empty(x.shape[0], w.codes.shape[0], dtype=torch.bfloat16)
    linear_int8_kernel()(out, x, pack_codes(w.codes, group=w.group), w.scales, None, 0, None, 2)
    return out


def _quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's x rule: per 32, scale amax / 127 in fp32, codes rounded half to even."""
    v = x.float().view(x.shape[0], -1, 32)
    scale = v.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(scale > 0, torch.round(v / scale), torch.zeros_like(v)).clamp(-127, 127)
    return codes.view(x.shape).to(torch.int64), scale.squeeze(-1)


def _weights(n: int, k: int, fmt: str, seed: int = 0) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if fmt == "int8":
        return quantize_per_channel(w)
    scales = torch.rand(n, k // 32, generator=gen) * 1e-3
    if fmt == "q8_0":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return Int8Weight(codes, scales, "q8_0")
    # Q4_0 / Q5_0 as recovered from a file: each block's codes in [-z, z - 1] or, where the
    # block's largest value was positive, [-z + 1, z] (z = 8 or 16).
    zero = 1 << (LOW_BIT_FORMATS[fmt] - 1)
    codes = torch.randint(-zero, zero, (n, k), generator=gen, dtype=torch.int8)
    flip = torch.rand(n, k // 32, 1, generator=gen) < 0.5
    codes = torch.where(flip, -codes.view(n, -1, 32), codes.view(n, -1, 32)).view(n, k)
    return Int8Weight(codes, scales, fmt)


ALL_FORMATS = ["int8", "q8_0", "q5_0", "q4_0"]  # Q4_K, Q6_K: test_linear_kquant.py


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, 5] = 0.0  # a zero column, and a whole zero group in the last row
    x[-1, :32] = 0.0
    return x.bfloat16()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_the_kernel_matches_a_float64_reference_of_its_quantized_operands(fmt):
    w = _weights(72, 192, fmt)
    x = _x(5, 192)
    codes, xscale = _quantize_x(x)
    xq = (codes.double().view(5, -1, 32) * xscale.double().unsqueeze(-1)).view(5, 192)
    terms = xq.unsqueeze(1) * w.dequantize().double().unsqueeze(0)  # [rows, N, K]
    ref, size = terms.sum(-1), terms.abs().sum(-1)
    got = _run(x, w).double()
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + size * 1e-6 + 1e-30).all()


def _model_of_the_kernel(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The kernel's documented order in Python (`_sums_of_the_kernel`), rounded to bf16."""
    return _sums_of_the_kernel(x, w).to(torch.bfloat16)


def _sums_of_the_kernel(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The kernel's documented order in Python, its fp32 sums: spans of 16 groups of 32 while
    they last, then 8, 4, 2 (2 always for groups of 16); in a span of n groups, lane l sums
    exactly the products it holds: columns 4 (t (16 / n) + l / n) + [0, 4) of the span's group
    l % n in step t; lane acc = fma(float(sum), wscale * xscale, acc) in fp32 once a span (the
    fma as one rounding of the exact float64 value); the lanes reduced (l, l+8), (l, l+4),
    (l, l+2), (l, l+1)."""
    codes, xscale = _quantize_x(x)
    rows, k = codes.shape
    n, group = w.codes.shape[0], w.group
    acc = torch.zeros(rows, n, 16, dtype=torch.float32)
    g0, groups = 0, k // 32
    while g0 < groups:
        width = 16 if group % 32 == 0 else 2
        while width > groups - g0:
            width //= 2
        cols = torch.tensor(
            [
                [
                    32 * (g0 + lane % width) + 4 * (t * (16 // width) + lane // width) + b
                    for t in range(width // 2)
                    for b in range(4)
                ]
                for lane in range(16)
            ]
        )
        sums = (codes[:, cols].unsqueeze(1) * w.codes.long()[:, cols].unsqueeze(0)).sum(-1)
        first = cols[:, 0]  # [16]: each lane's first column (all of a lane's in one group)
        scale = w.scales[:, first // group].unsqueeze(0) * xscale[:, first // 32].unsqueeze(1)
        exact = sums.double() * scale.float().double() + acc.double()
        acc = exact.float()
        g0 += width
    t = acc[..., :8] + acc[..., 8:]
    u = t[..., :4] + t[..., 4:]
    v = u[..., :2] + u[..., 2:]
    return v[..., 0] + v[..., 1]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_the_kernel_sums_in_its_one_documented_order_on_every_cpu_family(fmt):
    """K = 960: spans of 16, 8, 4 and 2 groups."""
    w = _weights(40, 960, fmt, seed=3)
    x = _x(3, 960, seed=4)
    assert torch.equal(_run(x, w), _model_of_the_kernel(x, w))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_a_float32_out_takes_the_documented_sums_unrounded(fmt):
    """The LM head's logits: into an fp32 out the kernel writes its fp32 sums (+ bias) as they
    are, the documented order's bits on every family, the same for a row alone and in a batch."""
    w = _weights(40, 960, fmt, seed=3)
    x = _x(6, 960, seed=4)
    bias = torch.randn(40).bfloat16()
    with_bias = assert_float32_out_is_the_sums(w, x, _sums_of_the_kernel(x, w), bias)
    assert torch.equal(with_bias.bfloat16(), _run(x, w, bias))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(fmt):
    w = _weights(150, 320, fmt)
    x = _x(11, 320)
    alone = torch.cat([_run(x[i : i + 1].contiguous(), w) for i in range(11)])
    for rows in (2, 3, 4, 5, 8, 11):
        assert torch.equal(_run(x[:rows].contiguous(), w), alone[:rows])


@pytest.mark.parametrize("gated", [False, True])
def test_a_decode_call_cut_into_long_chunks_gives_every_column_a_batch_rows_bits(gated):
    """Decode-sized calls (up to 4 rows) cut the weight into a multiple of `threads` chunks of
    up to ~2 MB, larger ones into ~32 KB: a 4.5 MB weight (on 2 threads two long chunks a
    thread, the last one narrower; on 3, one a thread) gives each column the bits it has in a
    5-row batch, on 1, 2 or 3 threads. The outputs start uninitialized: a column no chunk covers
    fails."""
    w = _weights(2208, 2048, "q8_0", seed=7)
    codes, scales = packed_weight(w)
    x = _x(5, 2048, seed=8)
    act = 1 if gated else 0
    n = 2208 // (2 if gated else 1)

    def run(rows: torch.Tensor, threads: int) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        linear_int8_kernel()(out, rows, codes, scales, None, act, None, threads)
        return out

    batch = run(x, 2)
    for threads in (1, 2, 3):
        assert torch.equal(run(x[:1].contiguous(), threads), batch[:1])
        assert torch.equal(run(x[:4].contiguous(), threads), batch[:4])


@pytest.mark.parametrize("fmt", ["q5_0", "q4_0"])
def test_4_and_5_bit_codes_give_the_bits_of_the_same_codes_in_8_bits(fmt):
    w = _weights(36, 448, fmt, seed=5)  # N not a multiple of 4: a padded group
    codes, _ = packed_weight(w)
    bits = LOW_BIT_FORMATS[fmt]
    assert codes.dtype == torch.uint8 and codes.shape == (9, 7, 4, 8 * bits)
    for rows in (1, 2, 5, 30):
        x = _x(rows, 448, seed=rows)
        assert torch.equal(_run(x, w), _run_8_bit(x, w))


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_0"])
def test_scales_float16_holds_are_read_in_float16_with_the_same_bits(fmt):
    """GGUF's own scales are fp16: packed in fp16 (half their bytes), the kernel gives the bits
    of the same scales in fp32, in its one documented order. K = 960: full spans (whose 16
    scales convert in one vector) and the narrower ones."""
    w = _weights(36, 960, fmt, seed=7)
    w = Int8Weight(w.codes, w.scales.half().float(), fmt)  # what a GGUF file's scales are
    codes, scales = packed_weight(w)
    assert scales.dtype == torch.float16 and torch.equal(scales.float().abs(), w.scales)
    for rows in (1, 3, 6):
        x = _x(rows, 960, seed=rows)
        out = torch.empty(rows, 36, dtype=torch.bfloat16)
        linear_int8_kernel()(out, x, codes, scales.float(), None, 0, None, 2)
        assert torch.equal(_run(x, w), out)
        assert torch.equal(_run(x, w), _model_of_the_kernel(x, w))


@pytest.mark.parametrize("group", [64, 320, 960])
def test_groups_wider_than_32_sum_in_spans_with_each_lanes_group_scale(group):
    """A scale per 64, 320 or 960 columns (K = 960): each lane's columns lie in one group of 32
    and so in one weight group, whose scale it takes; the documented order's bits."""
    gen = torch.Generator().manual_seed(group)
    codes = torch.randint(-127, 128, (20, 960), generator=gen, dtype=torch.int8)
    w = Int8Weight(codes, torch.rand(20, 960 // group, generator=gen) * 1e-3, "int8")
    for rows in (1, 5):
        x = _x(rows, 960, seed=rows)
        assert torch.equal(_run(x, w), _model_of_the_kernel(x, w))


def test_scales_float16_cannot_hold_stay_float32_and_the_kernel_refuses_them_elsewhere():
    """Scales fp16 would round (a per-channel int8 weight's amax / 127, random ones) stay fp32;
    fp16 scales are refused where the kernel reads them otherwise (a scale per channel)."""
    for fmt in ("int8", "q8_0"):
        assert packed_weight(_weights(8, 128, fmt))[1].dtype == torch.float32
    x = _x(1, 128)
    codes, scales = packed_weight(_weights(8, 128, "int8"))
    with pytest.raises(RuntimeError, match="float16 scales go with a scale per 32"):
        linear_int8_kernel()(
            torch.empty(1, 8, dtype=torch.bfloat16), x, codes, scales.half(), None, 0, None, 1
        )


def test_an_affine_weight_without_its_super_blocks_is_refused():
    w = _weights(8, 256, "q4_0")
    mins = torch.zeros_like(w.scales)
    with pytest.raises(ValueError, match="super-blocks"):
        packed_weight(Int8Weight(w.codes.abs(), w.scales, "q4_k", mins))


def test_codes_that_do_not_fit_their_bits_stay_8_bit_or_are_refused():
    w = _weights(8, 64, "q4_0")
    spans = w.codes.clone()
    spans[0, :2] = torch.tensor([-8, 8], dtype=torch.int8)  # a block that reaches both ends
    codes, scales = packed_weight(Int8Weight(spans, w.scales, "q4_0"))
    assert codes.dtype == torch.int8 and torch.equal(scales, w.scales)
    with pytest.raises(ValueError, match="do not fit 4 bits"):
        pack_codes(spans, 4, group=32)
    with pytest.raises(ValueError, match="4, 5 or 8 bits"):
        pack_codes(w.codes, 6, group=32)


def test_the_epilogues_round_as_the_separate_ops():
    w = _weights(64, 128, "q8_0")
    x = _x(6, 128)
    plain = _run(x, w)
    residual = torch.randn(6, 64).bfloat16()
    assert torch.equal(_run(x, w, residual=residual), (plain.float() + residual.float()).bfloat16())
    bias = torch.randn(64).bfloat16()
    with_bias = _run(x, w, bias=bias).float()
    assert torch.allclose(with_bias, plain.float() + bias.float(), rtol=2**-7, atol=1e-2)
    gate, up = plain[:, :32].float(), plain[:, 32:].float()
    gated = _run(x, w, act=1).float()
    assert torch.allclose(gated, F.silu(gate) * up, rtol=2**-6, atol=1e-3)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_0"])
def test_gguf_blocks_come_back_exactly_from_their_dequantized_values(fmt):
    """Values gguf's own quantizer made (and dequantized) give back their type and their
    blocks: the scale of each (as the file's fp16 d, up to sign) and codes that times it are
    the values exactly; Q8_0's codes are the file's bytes."""
    from gguf import GGMLQuantizationType, quants

    qtype = getattr(GGMLQuantizationType, fmt.upper())
    values = (torch.randn(24, 128) * 0.1).numpy()
    values[3, :32] = 0.0  # an all-zero block
    raw = quants.quantize(values, qtype)
    dequantized = torch.from_numpy(quants.dequantize(raw, qtype).copy())
    weight = recover_gguf_blocks(dequantized)
    assert weight is not None and weight.fmt == fmt and weight.group == 32
    assert torch.equal(weight.dequantize(), dequantized)
    block_bytes = raw.shape[1] // 4
    scales = raw.reshape(24, 4, block_bytes)[..., :2].copy().view(np.float16).astype(np.float32)
    assert torch.equal(weight.scales, torch.from_numpy(np.abs(scales[..., 0])))
    if fmt == "q8_0":
        codes = raw.reshape(24, 4, 34)[..., 2:].copy().view(np.int8).reshape(24, 128)
        assert torch.equal(weight.codes, torch.from_numpy(codes))
    else:  # every block of gguf's own quantizer fits its bits: the kernel reads 4 or 5 of them
        packed, _ = packed_weight(weight)
        assert packed.dtype == torch.uint8
        x = _x(3, 128)
        assert torch.equal(_run(x, weight), _run_8_bit(x, weight))


def _q6_k_values(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q6_K blocks (ql, qh, int8 sub-scales of either sign and some 0, an fp16 d),
    dequantized by gguf's own dequantizer: [rows, k] fp32."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    blocks = rows * k // 256
    ql = rng.integers(0, 256, (blocks, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (blocks, 64), dtype=np.uint8)
    sub = rng.integers(-128, 128, (blocks, 16)).astype(np.int8)
    sub[0, 3] = 0  # a sub-block of zeros
    d = (rng.random((blocks, 1)) * 1e-3).astype(np.float16)
    raw = np.concatenate([ql, qh, sub.view(np.uint8), d.view(np.uint8)], axis=1)
    values = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType.Q6_K)
    return torch.from_numpy(values.copy()).float()


def test_q6_k_blocks_come_back_exactly_with_a_scale_per_16():
    values = _q6_k_values(12, 512)
    weight = recover_gguf_blocks(values)
    assert weight is not None and weight.fmt == "q6_k" and weight.group == 16
    assert torch.equal(weight.dequantize(), values)
    assert int(weight.codes.abs().max()) <= 32


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_kernel_reads_a_scale_per_16_in_its_one_documented_order(rows):
    weight = recover_gguf_blocks(_q6_k_values(40, 256, seed=rows))
    x = _x(rows, 256, seed=rows)
    assert torch.equal(_run(x, weight), _model_of_the_kernel(x, weight))


def test_q4_1_blocks_are_declined():
    """gguf's own Q4_1 quantizer (fp16 scales and mins: the default model's file) is declined,
    so the default model keeps its bf16 values (Q4_K is read from the file's own super-blocks:
    tests/model/test_linear_kquant.py)."""
    from gguf import GGMLQuantizationType, quants

    values = (torch.randn(24, 128) * 0.1).numpy()
    qtype = GGMLQuantizationType.Q4_1
    dequantized = torch.from_numpy(quants.dequantize(quants.quantize(values, qtype), qtype).copy())
    assert recover_gguf_blocks(dequantized) is None


def test_shards_of_q4_0_q5_0_and_q8_0_fuse_as_8_bit_codes_exactly():
    """llama.cpp's Q4_K_M gives v more bits than q and k: the fused qkv keeps every shard's
    values as int8 codes with a scale per 32; other mixes are refused."""
    shards = [_weights(8, 64, fmt, seed=i) for i, fmt in enumerate(["q5_0", "q4_0", "q8_0"])]
    fused = fuse(shards)
    assert fused.fmt == "q8_0" and fused.group == 32
    assert torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in shards]))
    x = _x(3, 64)
    assert torch.equal(_run(x, fused), torch.cat([_run(x, w) for w in shards], dim=1))
    with pytest.raises(ValueError, match="share a format"):
        fuse([_weights(8, 64, "q5_0"), _weights(8, 64, "int8")])


def test_values_of_no_block_type_are_declined():
    assert recover_gguf_blocks(torch.randn(8, 64)) is None
    assert recover_gguf_blocks(torch.randn(8, 48)) is None  # K not a multiple of 32
    # An offset and 32 levels a block: more than Q4_K's / Q4_1's 16 codes.
    levels = (torch.arange(64).repeat(8, 1) * 0.01 + 0.003).float()
    assert recover_gguf_blocks(levels) is None


def test_per_channel_codes_are_within_half_a_step_of_each_weight():
    w = torch.randn(16, 64)
    w[2] = 0.0
    q = quantize_per_channel(w)
    assert q.group == 64 and q.codes.abs().max() <= 127
    step = q.scales.expand(16, 64)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(q.dequantize()[2], torch.zeros(64))


def test_a_linear_on_8_bit_weights_drops_its_bf16_weight_and_refuses_float32():
    linear = Linear(64, 32, bias=True).bfloat16()
    weight = quantize_per_channel(linear.weight)
    linear.set_int8(weight)
    assert linear.weight.numel() == 0 and linear.int8_format == "int8"
    x = _x(3, 64)
    assert torch.equal(linear(x), _run(x, weight, bias=linear.bias.detach()))
    with pytest.raises(TypeError, match="bfloat16 activations"):
        linear(x.float())
    with pytest.raises(ValueError, match="bfloat16 model"):
        Linear(64, 32).set_int8(weight)


def test_the_per_channel_codes_are_cached_on_disk(default_model_dir, monkeypatch, tmp_path):
    """A second load of the same checkpoint reads the first load's codes instead of quantizing
    again; a damaged cache file is quantized again and replaced."""
    from prefixserve.model.loader.loading import load_model

    monkeypatch.setattr(quantize_module, "cache_root", lambda: tmp_path)
    first = load_model(None, quantization="int8")
    cached = list((tmp_path / "quantized").glob("*.safetensors"))
    assert len(cached) == 1

    def refuse(_):
        raise AssertionError("quantized again instead of reading the cache")

    monkeypatch.setattr(quantize_module, "quantize_per_channel", refuse)
    second = load_model(None, quantization="int8")
    for name in ("lm_head", "model.layers.3.mlp.down_proj"):
        a, b = first.model.get_submodule(name), second.model.get_submodule(name)
        assert torch.equal(a._int8[0], b._int8[0]) and torch.equal(a._int8[1], b._int8[1])
    cached[0].write_bytes(b"not a safetensors file")
    monkeypatch.undo()
    monkeypatch.setattr(quantize_module, "cache_root", lambda: tmp_path)
    third = load_model(None, quantization="int8")
    assert torch.equal(third.model.lm_head._int8[0], first.model.lm_head._int8[0])


@pytest.fixture(scope="module")
def default_model_int8():
    from prefixserve.model.loader.loading import load_model

    return load_model(None, quantization="int8")


PROMPT = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 3


def _logprobs(output):
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]


def test_an_int8_engine_gives_a_cache_hit_the_cold_start_bits(default_model_int8):
    loaded = default_model_int8
    assert loaded.config.quantization == "int8+q8_0"  # the default file's embedding is Q8_0
    assert loaded.model.native_layers() is not None  # the native layer takes 8-bit linears
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    llm = LLM(loaded_model=loaded, num_kv_blocks=64, quantization="int8")
    cold = llm.generate([PROMPT], sp)[0]
    warm = llm.generate([PROMPT, PROMPT + "every"], sp)[0]
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert _logprobs(warm) == _logprobs(cold)
    assert "/weights-int8+q8_0/int8-spans16" in llm.llm_engine.runner.kv_numerics()


def test_the_disk_tiers_namespace_names_the_span_order_where_a_format_takes_it():
    """K/V computed under another summation order of 8-bit weights are no hits: the namespace
    names the span order for per-channel int8, Q8_0, Q5_0 and Q4_0, not for K-quants alone."""
    assert weights_numerics(None) == ""
    assert weights_numerics("q8_0") == f"/weights-q8_0/{SPAN_ORDER}"
    assert weights_numerics("q4_k+q6_k") == "/weights-q4_k+q6_k"
    assert weights_numerics("q4_0+q4_k") == f"/weights-q4_0+q4_k/{SPAN_ORDER}"
    assert weights_numerics("int8") != weights_numerics("q8_0")


def _native_and_python_layers_agree(loaded) -> None:
    """The same tokens and logprobs with the native decoder layers and the Python ones."""
    sp = SamplingParams(max_tokens=10, temperature=0, logprobs=1)
    outputs = []
    for native in (True, False):
        llm = LLM(loaded_model=loaded, num_kv_blocks=64)
        llm.llm_engine.runner.native_layers = native
        outputs.append(llm.generate([PROMPT, PROMPT[:40]], sp))
    for a, b in zip(*outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _logprobs(a) == _logprobs(b)


def test_native_and_python_layers_agree_over_8_bit_linears(default_model_int8):
    _native_and_python_layers_agree(default_model_int8)


def _blocks_of(weight: torch.Tensor, fmt: str) -> Int8Weight:
    """A bf16 weight quantized into one of the kept GGUF forms (for tests: not ggml's search)."""
    w = weight.detach().float()
    n, k = w.shape
    if fmt == "q4_k":
        return quantize_q4_k(w)
    if fmt == "q6_k_super":  # d per 256 in fp16, int8 sub-scales per 16, codes in [-32, 31]
        blocks = w.view(n, k // 16, 16)
        step = blocks.abs().amax(-1).clamp_min(1e-12) / 32
        d = (step.view(n, -1, 16).amax(-1, keepdim=True) / 127).half().float()
        sub = (step.view(n, -1, 16) / d).round().clamp(1, 127)
        scales = (d * sub).view(n, -1)
        codes = torch.round(blocks / scales.unsqueeze(-1)).clamp(-32, 31)
        supers = d.half().view(n, -1, 1)
        return Int8Weight(codes.to(torch.int8).view(n, k), scales, "q6_k", None, supers)
    group, top = {"q5_0": (32, 16), "q4_0": (32, 8), "q6_k": (16, 32)}[fmt]
    blocks = w.view(n, k // group, group)
    scales = blocks.abs().amax(-1).clamp_min(1e-12) / top
    codes = torch.round(blocks / scales.unsqueeze(-1)).clamp(-top, top - 1)
    return Int8Weight(codes.to(torch.int8).view(n, k), scales, fmt)


def test_native_and_python_layers_agree_over_4_5_and_6_bit_linears():
    """The native decoder layer passes 4/5-bit codes, a scale per 16 and Q4_K's and Q6_K's
    super-blocks to the kernel as the Python layer does: the same tokens and logprobs."""
    from prefixserve.model.layers.linear import link_next_weights
    from prefixserve.model.loader.loading import load_model

    loaded = load_model(None)
    # K = 576 (hidden) is no multiple of 256: the super-blocks go to down_proj (K = 1536).
    forms = {"qkv_proj": "q5_0", "o_proj": "q6_k", "gate_up_proj": "q4_0"}
    for name, module in loaded.model.named_modules():
        fmt = forms.get(name.rsplit(".", 1)[-1])
        if name.endswith("down_proj"):
            fmt = "q4_k" if int(name.split(".")[2]) % 2 else "q6_k_super"
        if fmt is not None and isinstance(module, Linear):
            module.set_int8(_blocks_of(module.weight, fmt))
    link_next_weights(loaded.model)
    loaded.model._native = False
    _native_and_python_layers_agree(loaded)


def test_speculative_decoding_over_8_bit_linears_keeps_the_greedy_output(default_model_int8):
    """8-bit weights and n-gram speculation: verification rows take the same kernel as decode
    rows (one summation order whatever the batch), so drafts change no token or logprob."""
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    prompt = PROMPT + PROMPT[:60]  # repeats, so the drafter finds n-grams
    outputs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(loaded_model=default_model_int8, num_kv_blocks=64, speculative_config=spec)
        outputs.append(llm.generate([prompt], sp)[0])
    plain, drafted = outputs
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert _logprobs(drafted) == _logprobs(plain)


def test_the_quantization_option_is_checked_where_it_is_given():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization == "auto"
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int8"])).quantization == (
        "int8"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        EngineConfig(quantization="int8", dtype="float32")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="fp8")


def test_lora_adapters_apply_over_8_bit_linears(tmp_path, default_model_fp32):
    """The seam of 8-bit weights and LoRA: an adapter's update is added to the 8-bit linear's
    output (the Python layers; the native layer takes no LoRA), so it changes the outputs, the
    base requests beside it keep theirs, and a cache hit keeps the cold start's bits."""
    from pathlib import Path

    from prefixserve.lora.config import LoRARequest
    from prefixserve.model.loader.loading import LoadedModel
    from tests.helpers.lora import make_adapter
    from tests.helpers.models import build_hf_model, build_ours

    shape = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    hf, config_json = build_hf_model("llama", tmp_path / "base", intermediate_size=128, **shape)
    make_adapter(hf, tmp_path / "adapter", rank=4, targets=["q_proj", "v_proj", "down_proj"])
    model, config = build_ours(hf, config_json, dtype="bfloat16")
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.shape[1] % 64 == 0:
            module.set_int8(quantize_per_channel(module.weight))
    loaded = LoadedModel(model, default_model_fp32.tokenizer, config, Path("."))
    llm = LLM(
        loaded_model=loaded, num_kv_blocks=128, block_size=4, enable_lora=True, max_lora_rank=8
    )
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [(5 * i + 3) % 200 for i in range(24)]}
    base_alone = llm.generate([prompt], sp)[0]
    cold = llm.generate([prompt], sp, lora_request=lora)[0]
    assert _logprobs(cold) != _logprobs(base_alone)  # the adapter moves the 8-bit model
    warm = llm.generate([prompt], sp, lora_request=lora)[0]
    assert warm.num_cached_tokens > 0
    assert _logprobs(warm) == _logprobs(cold)
    assert _logprobs(llm.generate([prompt], sp)[0]) == _logprobs(base_alone)
    llm.llm_engine.check_no_leaks()
