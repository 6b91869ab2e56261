"""The 8-bit KV cache (model/quant/kv_cache.py): the row format, the paged kernel reading it
against a float64 reference of the dequantized values, and an engine whose cache hits (pool and
disk tier) are its cold start's bits in each KV dtype."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.model.kernels.build import (
    attention_lanes_width,
    paged_attention_avx2_kernel,
    paged_attention_kernel,
    paged_attention_portable_kernel,
)
from prefixserve.model.quant.kv_cache import dequantize_rows, kv_format, quantize_rows
from tests.model.test_paged_attention_kernel import CASES, build_case, check_against_reference

FORMATS = ("int8", "fp8_e4m3")
needs_kernel = pytest.mark.skipif(paged_attention_kernel() is None, reason="no native kernel")


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_keeps_its_values_within_half_a_code(name):
    """Every value comes back within half a code step of its row's scale (int8), or within the
    format's relative precision (fp8 e4m3: 3 mantissa bits); the scale maps the row's largest
    magnitude to the largest code exactly."""
    fmt = kv_format(name, torch.bfloat16)
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * 4
    rows = quantize_rows(x, fmt)
    assert rows.dtype == fmt.storage and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, fmt, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if name == "int8":
        step = amax / 127
        assert ((back - x).abs() <= step / 2 + 1e-6 * amax).all()
    else:
        assert ((back - x).abs() <= x.abs() / 16 + amax / 448 * 2**-9 + 1e-6 * amax).all()
    torch.testing.assert_close(back.abs().amax(-1, keepdim=True), amax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_of_zeros_stays_zero_and_rows_are_independent(name):
    """A zero row is zeros (scale 1, no division by 0); a row's bytes depend on that row alone,
    so quantizing rows together or one by one gives the same bytes (what batch invariance and a
    cache hit need)."""
    fmt = kv_format(name, torch.float32)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(2))
    x[3] = 0
    together = quantize_rows(x, fmt)
    alone = torch.cat([quantize_rows(x[i : i + 1], fmt) for i in range(8)])
    assert torch.equal(together, alone)
    assert (dequantize_rows(together[3], fmt, torch.float32) == 0).all()


def test_an_unknown_kv_dtype_or_bf16_for_a_float32_model_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        kv_format("bf16", torch.float32)
    assert kv_format("auto", torch.float32).name == "float32"
    assert kv_format("bf16", torch.bfloat16).row_bytes(64) == 128
    assert kv_format("int8", torch.bfloat16).row_bytes(64) == 68


def _quantized_case(case, name, dtype, heads=6, kv_heads=2, head_dim=64, block_size=16):
    q, kc, vc, tables, info, truths = build_case(
        CASES[case], heads, kv_heads, head_dim, block_size, torch.float32
    )
    fmt = kv_format(name, dtype)
    kq, vq = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    deq = []
    for row, positions, keys, values in truths:
        deq.append(
            (
                row,
                positions,
                dequantize_rows(quantize_rows(keys, fmt), fmt, torch.float64),
                dequantize_rows(quantize_rows(values, fmt), fmt, torch.float64),
            )
        )
    return q.to(dtype), kq, vq, tables, info, deq


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 24])
def test_the_kernel_reads_8_bit_rows_as_their_dequantized_values(case, dtype, name, window):
    """The paged kernel over an 8-bit cache equals attention in float64 over the dequantized
    K/V (code * scale): decode batches, whole prompts, chunks over a cached prefix, mixed steps,
    sliding windows, GQA, query dtypes fp32 and bf16."""
    q, kq, vq, tables, info, truths = _quantized_case(case, name, dtype)
    check_against_reference(paged_attention_kernel(), q, kq, vq, tables, info, truths, window)


@needs_kernel
def test_every_fp8_byte_reads_as_pytorchs_float8_e4m3fn():
    """The kernels' fp8 decoding against PyTorch's conversion for all 256 bytes but the two
    NaNs: one key and one value row per byte, a query of zeros (all weight on the one key); the
    portable path's branch-free arithmetic (fp32 queries) and the bf16 lanes path's bit
    arithmetic (bf16 queries, where the build has it: an e4m3 value is exact in bf16), on its
    256-bit tiles too where the build's widest are the 512-bit ones."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    n = codes.numel()  # 254 rows of 64 copies of one byte each, scale 1
    one = torch.tensor([1.0]).view(torch.uint8)
    rows = torch.cat([codes.view(n, 1).expand(n, 64), one.expand(n, 4)], dim=1)
    want = codes.view(torch.float8_e4m3fn).float()
    tables = torch.tensor([[1]], dtype=torch.int32)
    info = torch.tensor([[0, 1, 0]], dtype=torch.int64)
    paths = [(paged_attention_portable_kernel(), torch.float32)]
    paths.append((paged_attention_kernel(), torch.bfloat16))
    if attention_lanes_width() == 512:
        paths.append((paged_attention_avx2_kernel(), torch.bfloat16))
    for kernel, dtype in paths:
        for i in range(n):  # each row alone in block 1 of a two-block cache (block 0 is null)
            cache = torch.zeros(2, 1, 1, 68, dtype=torch.uint8)
            cache[1, 0, 0] = rows[i]
            out = torch.empty(1, 64, dtype=dtype)
            kernel(out, torch.zeros(1, 1, 64, dtype=dtype), cache, cache, tables, info, 1.0, 0, 0)
            got, expected = out[0].float(), want[i].expand(64)
            assert torch.equal(got, expected), (dtype, hex(int(codes[i])), got[0], want[i])


PROMPT = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 3


def _logprobs(output):
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]


@pytest.mark.parametrize("name", FORMATS)
def test_a_cache_hit_is_the_cold_start_in_each_8_bit_dtype(name, default_model_bf16):
    """Greedy tokens and logprobs of a prompt cold, then from the pool's cached prefix batched
    with another request, then chunked: the same bits (the rows are written once, with their
    own scales, and read back by one kernel path)."""
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=64, kv_cache_dtype=name)
    cold = llm.generate([PROMPT], sp)[0]
    warm = llm.generate([PROMPT, PROMPT + "every"], sp)[0]
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert _logprobs(warm) == _logprobs(cold)


def test_the_pool_holds_about_twice_the_blocks_in_8_bits(default_model_bf16):
    """The same memory holds (head_dim * 2) / (head_dim + 4) times the blocks: 1.88x at 64."""

    def blocks(name):
        config = EngineConfig(
            dtype="bfloat16", cache=CacheConfig(kv_cache_memory_gb=0.05, kv_cache_dtype=name)
        )
        return LLMEngine(config, loaded_model=default_model_bf16).num_kv_blocks

    bf16, int8 = blocks("auto"), blocks("int8")
    assert abs(int8 / bf16 - 128 / 68) < 0.01, (bf16, int8)


def test_the_disk_tier_serves_8_bit_blocks_to_their_own_dtype_only(default_model_bf16, tmp_path):
    """An int8 engine's blocks come back from disk (a fresh engine: its pool is empty) with the
    cold start's bits; an fp8 or bf16 engine over the same directory finds none of them (the
    namespace names the KV dtype), and its cache report names the dtype the block is in."""
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1)

    def engine(name):
        return LLM(
            loaded_model=default_model_bf16,
            num_kv_blocks=64,
            kv_cache_dtype=name,
            kv_store_dir=str(tmp_path),
            kv_store_gb=0.0625,
        )

    first = engine("int8")
    cold = first.generate([PROMPT], sp)[0]
    first.llm_engine.kv_connector.close()
    again = engine("int8").generate([PROMPT], sp)[0]
    assert again.num_cached_tokens > 0
    assert _logprobs(again) == _logprobs(cold)
    reported = SamplingParams(max_tokens=8, temperature=0, cache_report=True)
    for other in ("fp8_e4m3", "auto"):
        out = engine(other).generate([PROMPT], reported)[0]
        assert out.num_cached_tokens == 0
        # The report says why: the block is on disk, in the int8 engine's dtype.
        assert out.cache_report["reason"] == "other_kv_dtype"
        assert out.cache_report["detail"] == {"kv_dtype": "int8"}
    # Only the same namespace's block is named: under another cache salt it was never seen.
    salted = engine("auto").generate([{"prompt": PROMPT, "cache_salt": "other"}], reported)[0]
    assert salted.cache_report["reason"] == "never_seen"


def test_metrics_and_the_summary_name_the_kv_dtype_and_bytes_per_token(default_model_bf16):
    """`get_metrics`, `/metrics` (Prometheus text), the cache summary and replicas' combined
    metrics all say how the pool stores K/V: 30 layers x 3 KV heads x K and V x 68 bytes."""
    from prefixserve.engine.metrics import combine_metrics
    from prefixserve.entrypoints.server.metrics import ServerMetrics

    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=16, kv_cache_dtype="int8")
    engine = llm.llm_engine
    config = engine.model_config
    want = 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)
    metrics = engine.get_metrics()
    assert metrics["kv_cache_dtype"] == "int8"
    assert metrics["kv_cache_bytes_per_token"] == want
    summary = engine.cache_summary()
    assert summary["kv_cache"] == {"dtype": "int8", "bytes_per_token": want}
    server = ServerMetrics()
    server.update_engine(metrics)
    text = server.render().decode()
    assert 'prefixserve_kv_cache_dtype_info{kv_cache_dtype="int8"} 1.0' in text
    assert f"prefixserve_kv_cache_bytes_per_token {float(want)}" in text
    both = combine_metrics([metrics, dict(metrics)])
    assert both["kv_cache_dtype"] == "int8" and both["kv_cache_bytes_per_token"] == want
    assert "kv_cache_dtype" not in combine_metrics([metrics, {**metrics, "kv_cache_dtype": "bf16"}])


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_kernel_writes_8_bit_rows_as_pytorch_quantizes_them(dtype, name):
    """The native layer's K/V write (`rope_write_kv` into an int8 or fp8 cache) gives
    quantize_rows' bytes for the rotated K and for V, bit for bit: a token's row is the same
    whichever path wrote it (a large chunk in PyTorch, a decode step in the kernel). Rows
    include a zero row, tiny values (fp8 subnormals) and values at rounding ties."""
    from prefixserve.model.kernels.build import rope_write_kv_kernel
    from prefixserve.model.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(5)
    tokens, q_heads, kv_heads, d = 7, 6, 2, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=g).to(dtype)
    qkv[2, q_heads * d : (q_heads + 1) * d] = 0  # a K row of zeros
    qkv[3, (q_heads + kv_heads) * d :] *= torch.logspace(
        -9, 0, (qkv.shape[1] - (q_heads + kv_heads) * d)
    )
    qkv[4, (q_heads + kv_heads) * d : (q_heads + kv_heads) * d + 8] = torch.tensor(
        [448.0, 13.0, -13.5, 0.5, -0.0, 7.0, 1e-4, -(2.0**-9)]
    ).to(dtype)
    angles = torch.rand(tokens, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    fmt = kv_format(name, dtype)
    k_cache = torch.zeros(4, 4, kv_heads, d + 4, dtype=fmt.storage)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 0, 5, 9, 10, 14, 15])
    k = apply_rotary(
        qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d),
        cos.view(tokens, 1, d),
        sin.view(tokens, 1, d),
    )
    v = qkv[:, (q_heads + kv_heads) * d :].reshape(tokens, kv_heads, d).clone()
    rope_write_kv_kernel()(qkv, cos, sin, q_heads, kv_heads, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d + 4), v_cache.view(-1, kv_heads, d + 4)
    assert torch.equal(flat_k[slots], quantize_rows(k, fmt))
    assert torch.equal(flat_v[slots], quantize_rows(v, fmt))
