"""GGUF Q4_K and Q6_K weights in super-blocks (model/quant/weights.py `q4_k_from_raw`,
`q6_k_from_raw`, `pack_q4_k`, `pack_q6_k`; csrc/linear/kquant.h, linear_q4k.cpp, linear_q6k.cpp;
the loader's `gguf_convert.KQuantRows`).

The kernels are pinned to a float64 reference of their quantized operands (within bf16's
rounding) and bit for bit to a Python model of their one order (per super-block exact integers,
then one or two fused multiply-adds), which every CPU family's build must match; a row's bits do
not depend on the batch. The file's blocks come back exactly, matched to transformers' values
row by row, and a Q4_K_M GGUF model gives a cache hit the cold start's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixserve.model.kernels.build import linear_int8_kernel
from prefixserve.model.quant.weights import (
    Int8Weight,
    fuse,
    pack_q4_k,
    pack_q6_k,
    packed_weight,
    q4_k_from_raw,
    q6_k_from_raw,
    quantize_q4_k,
)
from tests.helpers.linear_int8 import assert_float32_out_is_the_sums

pytestmark = pytest.mark.skipif(linear_int8_kernel() is None, reason="kernels not built")


def _raw_q4_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random ggml block_q4_K rows, uint8 [n, k / 256 x 144]: any nibbles and 6-bit sub-scales
    and mins (some 0), fp16 d and dmin (one super-block all zero)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    supers = (rng.random((n, k // 256, 2)) * 1e-3).astype(np.float16)
    supers[0, 0] = 0.0
    blocks[..., :4] = supers.view(np.uint8).reshape(n, -1, 4)
    return blocks.reshape(n, -1)


def _raw_q6_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random ggml block_q6_K rows, uint8 [n, k / 256 x 210]: any 6-bit codes, int8 sub-scales
    (some 0, either sign, -128 too), fp16 d (one super-block's 0)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[0, 0, 192] = 0  # a zero sub-scale
    blocks[-1, -1, 193] = 128  # -128
    d = (rng.random((n, k // 256, 1)) * 1e-3).astype(np.float16)
    d[-1, 0] = 0.0
    blocks[..., 208:] = d.view(np.uint8).reshape(n, -1, 2)
    return blocks.reshape(n, -1)


def _weight(n: int, k: int, seed: int = 0, fmt: str = "q4_k") -> Int8Weight:
    if fmt == "q6_k":
        return q6_k_from_raw(torch.from_numpy(_raw_q6_k(n, k, seed)))
    return q4_k_from_raw(torch.from_numpy(_raw_q4_k(n, k, seed)))


FORMATS = ["q4_k", "q6_k"]


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 2
    x[:, 7] = 0.0  # a zero column, a whole zero super-block in the last row, a large value
    x[-1, :256] = 0.0
    x[0, 300 % k] = 40.0
    if rows > 2:  # halves after the division by the scale (127 / 127 = 1): ties to even
        x[1, :256] = torch.arange(256) % 64 - 31.5
        x[1, 0] = 127.0
    return x.bfloat16()


def _run(x: torch.Tensor, w: Int8Weight, act: int = 0, residual=None) -> torch.Tensor:
    n = w.codes.shape[0] // (2 if act else 1)
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    codes, scales = packed_weight(w)
    linear_int8_kernel()(out, x, codes, scales, None, act, residual, 2)
    return out


def _quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's x rule per super-block: scale amax / 127 in fp32, codes rounded half to
    even in [-127, 127]; (codes int64 [rows, K], scales fp32 [rows, K / 256])."""
    v = x.float().view(x.shape[0], -1, 256)
    scale = v.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(scale > 0, torch.round(v / scale), torch.zeros_like(v)).clamp(-127, 127)
    return codes.view(x.shape).to(torch.int64), scale.squeeze(-1)


def _sub_ints(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(sub-scales, sub-mins) int64 [N, K / 256, 8]."""
    n = w.codes.shape[0]
    d = w.super_scales[..., 0].float().unsqueeze(-1)
    dmin = w.super_scales[..., 1].float().unsqueeze(-1)
    sc = torch.where(d > 0, w.scales.view(n, -1, 8) / d.clamp_min(1e-38), 0.0).round()
    m = torch.where(dmin > 0, -w.mins.view(n, -1, 8) / dmin.clamp_min(1e-38), 0.0).round()
    return sc.long(), m.long()


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma as one rounding of the float64 value (a x b exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def _model_of_q6_k(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """Q6_K's documented order: per super-block b, S = sum_j sc_j (sum of q x over sub-block j
    of 16) - 32 sum_j sc_j (sum of its x codes), exact; acc = fma(float(S), d xs, acc)."""
    codes, xscale = _quantize_x(x)
    rows, k = codes.shape
    n, blocks = w.codes.shape[0], k // 256
    xq = codes.view(rows, blocks, 16, 16)
    q = (w.codes.long() + 32).view(n, blocks, 16, 16)
    d = w.super_scales[..., 0].float()  # [N, blocks]
    sc = torch.where(d.unsqueeze(-1) != 0, w.scales.view(n, blocks, 16) / d.unsqueeze(-1), 0.0)
    sc = sc.round().long()
    dots = torch.einsum("rbjt,nbjt->rnbj", xq.double(), q.double()).long()
    S = (dots * sc.unsqueeze(0)).sum(-1) - 32 * (xq.sum(-1).unsqueeze(1) * sc.unsqueeze(0)).sum(-1)
    acc = torch.zeros(rows, n, dtype=torch.float32)
    for b in range(blocks):
        acc = _fma(S[..., b].double().float(), d[:, b].unsqueeze(0) * xscale[:, b : b + 1], acc)
    return acc


def _model_of_the_kernel(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """`_sums_of_the_kernel` rounded to bf16, as a plain call with a bf16 out writes them."""
    return _sums_of_the_kernel(x, w).bfloat16()


def _sums_of_the_kernel(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The documented order, fp32 sums: per super-block b, S = sum_j sc_j (sum of q x over
    sub-block j) and M = sum_j m_j (sum of sub-block j's x codes), exact;
    acc = fma(float(S), d xs, acc), then acc = fma(-float(M), dmin xs, acc), from 0 over the
    super-blocks in order (Q6_K: `_model_of_q6_k`)."""
    if w.fmt == "q6_k":
        return _model_of_q6_k(x, w)
    codes, xscale = _quantize_x(x)
    rows, k = codes.shape
    n, blocks = w.codes.shape[0], k // 256
    xq = codes.view(rows, blocks, 8, 32)
    wq = w.codes.long().view(n, blocks, 8, 32)
    sc, m = _sub_ints(w)
    dots = torch.einsum("rbjt,nbjt->rnbj", xq.double(), wq.double()).long()  # exact (< 2^53)
    S = (dots * sc.unsqueeze(0)).sum(-1)  # [rows, N, blocks]
    M = (xq.sum(-1).unsqueeze(1) * m.unsqueeze(0)).sum(-1)
    d = w.super_scales[..., 0].float().unsqueeze(0)
    dmin = w.super_scales[..., 1].float().unsqueeze(0)
    acc = torch.zeros(rows, n, dtype=torch.float32)
    for b in range(blocks):
        xs = xscale[:, b].unsqueeze(1)
        acc = _fma(S[..., b].double().float(), d[..., b] * xs, acc)
        acc = _fma(-M[..., b].double().float(), dmin[..., b] * xs, acc)
    return acc


def test_q4_k_blocks_read_from_the_file_give_ggufs_own_values_exactly():
    from gguf import GGMLQuantizationType, quants

    raw = _raw_q4_k(12, 512)
    weight = q4_k_from_raw(torch.from_numpy(raw))
    values = quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    assert weight.fmt == "q4_k" and weight.group == 32
    assert torch.equal(weight.dequantize(), torch.from_numpy(values.copy()))
    assert int(weight.codes.min()) >= 0 and int(weight.codes.max()) <= 15
    assert weight.super_scales.shape == (12, 2, 2) and weight.super_scales.dtype == torch.float16


def test_q6_k_blocks_read_from_the_file_give_ggufs_own_values_exactly():
    from gguf import GGMLQuantizationType, quants

    raw = _raw_q6_k(12, 512)
    weight = q6_k_from_raw(torch.from_numpy(raw))
    values = quants.dequantize(raw, GGMLQuantizationType.Q6_K)
    assert weight.fmt == "q6_k" and weight.group == 16 and weight.mins is None
    assert torch.equal(weight.dequantize(), torch.from_numpy(values.copy()))
    assert weight.super_scales.shape == (12, 2, 1)
    codes, d = pack_q6_k(weight)
    assert codes.shape == (3, 2, 832) and d.shape == (12, 2) and d.dtype == torch.float16


def test_the_packed_layout_is_groups_of_four_rows_each_lanes_nibbles_in_one_sub_block():
    """Byte 4 L + t of a row's load p (its bytes 64 p..) holds column 128 p + 8 L + t in its low
    nibble and column + 4 in its high one: each 32-bit lane's eight codes lie in one sub-block
    of 32 (linear_q4k.cpp sums them in one lane). Checked against the codes, not the packer's
    own order."""
    raw = _raw_q4_k(6, 512, seed=2)  # N not a multiple of 4: the last group padded
    weight = q4_k_from_raw(torch.from_numpy(raw))
    codes, d_dmin = pack_q4_k(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 2, 576)
    assert d_dmin.dtype == torch.float16 and d_dmin.shape == (6, 4)
    values = weight.codes.view(6, 2, 256)
    for row in (0, 5):
        group, slot = divmod(row, 4)
        for b in range(2):
            got = codes[group, b].numpy()
            for byte in range(128):
                p, lane, t = byte // 64, (byte % 64) // 4, byte % 4
                column = 128 * p + 8 * lane + t
                low, high = values[row, b, column], values[row, b, column + 4]
                assert got[128 * slot + byte] == int(low) | int(high) << 4, (row, b, byte)
                assert column // 32 == (column + 4) // 32  # one sub-block
            sc, m = _sub_ints(weight)
            assert (got[512 + 8 * slot : 520 + 8 * slot] == sc[row, b].numpy()).all()
            assert (got[544 + 8 * slot : 552 + 8 * slot] == m[row, b].numpy()).all()
    assert (codes[1, :, 256:512] == 0).all()  # rows 6 and 7 do not exist
    assert torch.equal(d_dmin.view(6, 2, 2), weight.super_scales)


def test_scales_that_are_not_d_times_6_bit_integers_are_refused():
    weight = _weight(4, 256)
    bad = weight.scales.clone()
    bad[1, 0] = weight.super_scales[1, 0, 0].float() * 64  # d times 64: not 6 bits
    with pytest.raises(ValueError, match="6-bit integers"):
        pack_q4_k(Int8Weight(weight.codes, bad, "q4_k", weight.mins, weight.super_scales))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_matches_a_float64_reference_of_its_quantized_operands(fmt):
    w = _weight(40, 768, seed=3, fmt=fmt)
    x = _x(5, 768)
    codes, xscale = _quantize_x(x)
    xq = (codes.double().view(5, -1, 256) * xscale.double().unsqueeze(-1)).view(5, 768)
    terms = xq.unsqueeze(1) * w.dequantize().double().unsqueeze(0)
    ref, size = terms.sum(-1), terms.abs().sum(-1)
    got = _run(x, w).double()
    assert ((got - ref).abs() <= ref.abs() * 2**-8 + size * 1e-6 + 1e-30).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_the_kernel_sums_in_its_one_documented_order_on_every_cpu_family(rows, fmt):
    w = _weight(38, 512, seed=rows, fmt=fmt)  # N not a multiple of 4
    x = _x(rows, 512, seed=rows)
    assert torch.equal(_run(x, w), _model_of_the_kernel(x, w))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("k", [1024, 1280, 2048])
def test_a_lone_x_rows_fp32_sums_over_many_super_blocks_keep_the_documented_order(k, rows, fmt):
    """A lone x row's tile (decode; the fifth row of five) over 4 to 8 super-blocks: its fp32
    sums (an fp32 out, where a changed order shows in the last bits a bf16 out would round
    away) stay the documented order's."""
    w = _weight(22, k, seed=k + rows, fmt=fmt)  # N not a multiple of 4: tiles of 4, 2 and 1 rows
    x = _x(rows, k, seed=k)
    out = torch.empty(rows, 22, dtype=torch.float32)
    codes, scales = packed_weight(w)
    linear_int8_kernel()(out, x, codes, scales, None, 0, None, 2)
    assert torch.equal(out, _sums_of_the_kernel(x, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_float32_out_takes_the_documented_sums_unrounded(fmt):
    """A K-quant LM head's logits (Q4_K_M files keep the head in Q6_K): into an fp32 out the
    kernel writes its fp32 sums (+ bias) unrounded, the same for a row alone and in a batch."""
    w = _weight(38, 512, seed=8, fmt=fmt)
    x = _x(6, 512, seed=9)
    assert_float32_out_is_the_sums(w, x, _sums_of_the_kernel(x, w), torch.randn(38).bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(fmt):
    w = _weight(150, 512, seed=4, fmt=fmt)
    x = _x(11, 512, seed=5)
    alone = torch.cat([_run(x[i : i + 1].contiguous(), w) for i in range(11)])
    for rows in (2, 3, 4, 5, 6, 8, 11):
        assert torch.equal(_run(x[:rows].contiguous(), w), alone[:rows])


def test_the_epilogues_take_q4_k_sums_as_any_others():
    w = _weight(64, 256, seed=6)
    x = _x(6, 256, seed=7)
    plain = _run(x, w)
    residual = torch.randn(6, 64).bfloat16()
    got = _run(x, w, residual=residual)
    assert torch.equal(got, (plain.float() + residual.float()).bfloat16())
    gate, up = plain[:, :32].float(), plain[:, 32:].float()
    gated = _run(x, w, act=1).float()
    assert torch.allclose(gated, torch.nn.functional.silu(gate) * up, rtol=2**-6, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_shards_give_each_shards_bits(fmt):
    shards = [_weight(8, 256, seed=s, fmt=fmt) for s in (8, 9, 10)]
    fused = fuse(shards)
    assert fused.super_scales is not None and fused.super_scales.shape[0] == 24
    x = _x(3, 256)
    assert torch.equal(_run(x, fused), torch.cat([_run(x, w) for w in shards], dim=1))


def test_q4_k_shards_then_q6_k_ones_fuse_into_one_call_with_each_shards_bits():
    """llama.cpp's Q4_K_M gives v Q6_K where q and k are Q4_K: the fused qkv is one call over
    both parts (Q4_K's rows a multiple of 4), every row with its own format's bits."""
    shards = [_weight(8, 512, seed=15), _weight(4, 512, seed=16), _weight(6, 512, 17, "q6_k")]
    fused = fuse(shards)
    assert fused.fmt == "q4_k+q6_k" and fused.parts is not None
    assert torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in shards]))
    codes, scales = packed_weight(fused)
    assert codes.dim() == 1 and scales.shape == (18, 4)
    for rows in (1, 3, 6):
        x = _x(rows, 512, seed=rows)
        assert torch.equal(_run(x, fused), torch.cat([_run(x, w) for w in shards], dim=1))
    with pytest.raises(ValueError, match="share a format"):
        fuse([_weight(6, 512, seed=15), _weight(6, 512, 17, "q6_k")])  # 6 Q4_K rows
    with pytest.raises(ValueError, match="share a format"):
        fuse([_weight(4, 512, 17, "q6_k"), _weight(8, 512, seed=15)])  # Q6_K first


def test_a_simply_quantized_weight_is_close_to_its_values():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(16, 512, generator=gen) * 0.05
    q = quantize_q4_k(w)
    assert q.super_scales is not None
    step = q.scales.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    pack_q4_k(q)  # its scales are d times 6-bit integers, exactly


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """A GGUF file holding these raw tensors (uint8 rows of the named GGML type's blocks)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=getattr(GGMLQuantizationType, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_loader_matches_k_quant_values_to_the_files_blocks_row_by_row(tmp_path):
    """transformers hands over each tensor dequantized, some with rows reordered (Llama's q and
    k): the rows are found among the file's Q4_K and Q6_K tensors by their values and kept
    exactly; values of no such tensor (or of two) are declined."""
    from prefixserve.model.loader.gguf_convert import KQuantRows
    from prefixserve.model.loader.gguf_reader import one_reader_per_file

    raws = {
        "a.weight": (_raw_q4_k(16, 512, seed=12), "Q4_K"),
        "b.weight": (_raw_q4_k(16, 512, seed=13), "Q4_K"),
        "c.weight": (_raw_q6_k(8, 768, seed=14), "Q6_K"),
    }
    _write_gguf(tmp_path / "m.gguf", raws)
    with one_reader_per_file():
        rows = KQuantRows(tmp_path / "m.gguf")
        a = q4_k_from_raw(torch.from_numpy(raws["a.weight"][0]))
        order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
        found = rows.recover(a.dequantize()[order].contiguous())
        assert found is not None and torch.equal(found.dequantize(), a.dequantize()[order])
        assert torch.equal(found.codes, a.codes[order])
        assert torch.equal(found.super_scales, a.super_scales[order])
        c = q6_k_from_raw(torch.from_numpy(raws["c.weight"][0]))
        found = rows.recover(c.dequantize())
        assert found is not None and found.fmt == "q6_k"
        assert torch.equal(found.codes, c.codes) and torch.equal(found.scales, c.scales)
        b = q4_k_from_raw(torch.from_numpy(raws["b.weight"][0])).dequantize()
        mixed = torch.cat([a.dequantize()[:8], b[8:]])
        assert rows.recover(mixed) is None
        assert rows.recover(torch.randn(16, 512)) is None


def test_a_q4_k_m_gguf_model_gives_a_cache_hit_the_cold_starts_tokens():
    """Gemma 3 270M's packaged Q4_K_M file: its Q4_K linears are kept in super-blocks, and a
    request served from a warm cache (its prompt's blocks hit, the rest prefilled, then decode)
    gets the tokens and logprobs of the same request served cold."""
    from prefixserve.llm import LLM
    from prefixserve.model.loader.default_model import ensure_gemma3_270m
    from prefixserve.model.loader.loading import load_model
    from prefixserve.sampling_params import SamplingParams

    loaded = load_model(ensure_gemma3_270m(), dtype="bfloat16")
    assert "q4_k" in (loaded.config.quantization or "")
    o_proj = loaded.model.get_submodule("model.layers.0.self_attn.o_proj")
    assert o_proj.int8_format == "q4_k" and o_proj._int8[0].shape[-1] == 576
    prompt = "Once upon a time in a small village by the sea, there lived an old fisherman " * 4
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    llm = LLM(loaded_model=loaded, num_kv_blocks=128)
    cold = llm.generate([prompt], sp)[0]
    again = llm.generate([prompt], sp)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert _logprobs(again) == _logprobs(cold)
    # The last decoded token again, from a prefill of the prompt and the tokens before it (no
    # cache): a prefill row gets a decode row's bits.
    tokens = list(cold.outputs[0].token_ids)
    ids = {"prompt_token_ids": list(cold.prompt_token_ids) + tokens[:-1]}
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    cold_llm = LLM(loaded_model=loaded, num_kv_blocks=128, enable_prefix_caching=False)
    last = cold_llm.generate([ids], one)[0]
    assert last.outputs[0].token_ids == tokens[-1:]
    assert _logprobs(last) == _logprobs(cold)[-1:]


def _logprobs(output) -> list[float]:
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]
