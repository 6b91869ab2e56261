"""The paged kernel's bf16 keys-in-lanes path (csrc/attention/paged_lanes.cpp) and the long-chunk
kernel (csrc/attention/prefill_attention.cpp) share their arithmetic
(csrc/attention/attn_lanes_bf16_avx512.h): a query's
output is the same bits from either, however its prompt was chunked, whatever rows shared its
call, whether it was a decode row of a cascade over a shared prefix, and within a sliding window.
Both are also checked against an fp64 reference and against the portable path. The tiles come
in two widths with the same bits: 512-bit (AVX512-BF16 and VNNI: attn_lanes_bf16_avx512.h,
attn_lanes_int8_avx512.h) and 256-bit (AVX2: attn_lanes_bf16_avx2.h, attn_lanes_int8_avx2.h); where
a build has the wider, the paged kernel's tests run on both and their bits are compared.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.model.kernels.build import (
    attention_kernels_agree,
    attention_lanes_width,
    paged_attention_avx2_kernel,
    paged_attention_kernel,
    paged_attention_portable_kernel,
    prefill_attention_kernel,
)
from prefixserve.model.kernels.cpu_paths import cpuinfo
from prefixserve.model.quant.kv_cache import dequantize_rows, kv_format, quantize_rows
from prefixserve.settings import kernel_march

paged = paged_attention_kernel()
portable = paged_attention_portable_kernel()
prefill = prefill_attention_kernel()
needs_lanes = pytest.mark.skipif(
    paged is None or not attention_kernels_agree(),
    reason="this build has no keys-in-lanes path (no AVX2)",
)
lanes_width = 0 if paged is None else attention_lanes_width()
avx2_tiles = paged_attention_avx2_kernel()


def paged_avx2(out, q, kc, vc, table, info, scale, softcap, window):
    """The paged kernel on its 256-bit keys-in-lanes tiles, whatever the build's widest."""
    assert avx2_tiles(out, q, kc, vc, table, info, scale, softcap, window)


# A paged-kernel test on the build's widest tiles and on the 256-bit ones.
PAGED_KERNELS = pytest.mark.parametrize("kernel", [paged, paged_avx2], ids=["widest", "avx2"])


def prompt_case(length, heads, kv_heads, head_dim, block_size, seed):
    """One sequence of `length` tokens scattered over shuffled blocks (block 0 NaN, never
    referenced): q [length, heads, D], the caches, its table [1, blocks], and its K/V in order."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-length // block_size)
    num_blocks = blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, generator=g).bfloat16()
    vc = torch.randn(shape, generator=g).bfloat16()
    kc[0] = float("nan")
    vc[0] = float("nan")
    table = (torch.randperm(num_blocks - 1, generator=g)[:blocks] + 1).to(torch.int32)
    slots = (table.long().unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)[:length]
    keys = kc.view(-1, kv_heads, head_dim)[slots]
    values = vc.view(-1, kv_heads, head_dim)[slots]
    q = torch.randn(length, heads, head_dim, generator=g).bfloat16()
    return q, kc, vc, table.unsqueeze(0), keys, values


def run_chunks(fn, q, kc, vc, table, cuts, window=0, softcap=0.0):
    """The prompt served chunk by chunk ([cuts[i], cuts[i + 1]) each, its prefix cached)."""
    length, heads, d = q.shape
    out = torch.empty(length, heads * d, dtype=torch.bfloat16)
    for a, b in zip(cuts, cuts[1:], strict=False):
        o = torch.empty(b - a, heads * d, dtype=torch.bfloat16)
        info = torch.tensor([[0, b - a, a]])
        fn(o, q[a:b], kc, vc, table, info, d**-0.5, softcap, window)
        out[a:b] = o
    return out


def run_decode_rows(q, kc, vc, table, window=0, fn=None):
    """Every position as its own one-token sequence, all in one call (a decode batch whose rows
    share the prompt's blocks: cascades); `fn`: the kernel (paged by default)."""
    length, heads, d = q.shape
    out = torch.empty(length, heads * d, dtype=torch.bfloat16)
    info = torch.tensor([[i, i + 1, i] for i in range(length)])
    (fn or paged)(out, q, kc, vc, table.repeat(length, 1), info, d**-0.5, 0.0, window)
    return out


def exact(q, keys, values, window=0):
    """fp64 causal attention of a whole prompt (window 0: none)."""
    length, heads, d = q.shape
    rep = heads // keys.shape[1]
    k = keys.double().repeat_interleave(rep, 1)
    v = values.double().repeat_interleave(rep, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), k) * d**-0.5
    pos = torch.arange(length)
    mask = pos.unsqueeze(0) <= pos.unsqueeze(1)
    if window:
        mask &= pos.unsqueeze(0) > pos.unsqueeze(1) - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), v).reshape(length, heads * d)


SHAPES = [(9, 3, 64), (4, 2, 128), (4, 1, 256)]


@needs_lanes
@PAGED_KERNELS
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_paged_and_prefill_kernels_give_the_same_bits(kernel, heads, kv_heads, head_dim):
    """A 300-token prompt: one paged call, the prefill kernel over its gathered K/V (where the
    build has it), the paged kernel chunk by chunk, the prefill kernel on its last chunk over
    the rest, every position as a decode row: all equal, bit for bit, and within bf16 rounding
    of fp64 attention; the paged kernel's 256-bit tiles too."""
    q, kc, vc, table, keys, values = prompt_case(300, heads, kv_heads, head_dim, 16, seed=1)
    whole = run_chunks(kernel, q, kc, vc, table, [0, 300])
    if prefill is not None:
        gathered = torch.empty_like(whole)
        prefill(gathered, q, keys, values, head_dim**-0.5)
        assert torch.equal(whole, gathered)
        tail = torch.empty(130, heads * head_dim, dtype=torch.bfloat16)
        prefill(tail, q[170:], keys, values, head_dim**-0.5)
        assert torch.equal(whole[170:], tail)
    assert torch.equal(whole, run_chunks(kernel, q, kc, vc, table, [0, 100, 107, 108, 170, 300]))
    assert torch.equal(whole, run_decode_rows(q, kc, vc, table, fn=kernel))
    truth = exact(q, keys, values)
    assert (whole.double() - truth).abs().max().item() < 0.02
    slow = run_chunks(portable, q, kc, vc, table, [0, 300])
    assert (whole.double() - slow.double()).abs().max().item() < 0.02


@needs_lanes
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    length=st.integers(1, 200),
    cuts=st.lists(st.integers(1, 199), max_size=5),
    block_size=st.sampled_from([8, 16, 48]),
    window=st.sampled_from([0, 0, 5, 70]),
    seed=st.integers(0, 3),
)
def test_any_chunking_gives_the_same_bits(length, cuts, block_size, window, seed):
    """Hypothesis over prompt length, chunk cuts, block sizes that do and do not divide the
    64-key tile, and sliding windows: every chunking and the decode rows equal one call."""
    q, kc, vc, table, keys, values = prompt_case(length, 9, 3, 64, block_size, seed)
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    whole = run_chunks(paged, q, kc, vc, table, [0, length], window)
    assert torch.equal(whole, run_chunks(paged, q, kc, vc, table, bounds, window))
    assert torch.equal(whole, run_decode_rows(q, kc, vc, table, window))
    assert (whole.double() - exact(q, keys, values, window)).abs().max().item() < 0.02
    if window == 0 and length >= 1 and prefill is not None:
        gathered = torch.empty_like(whole)
        prefill(gathered, q, keys, values, 64**-0.5)
        assert torch.equal(whole, gathered)


@needs_lanes
@PAGED_KERNELS
def test_a_row_gets_the_same_bits_whatever_shares_its_call(kernel):
    """A decode row alone, then in a batch with other sequences' decode rows and chunks (some
    sharing its prefix blocks, so it joins a cascade): the same bits."""
    q, kc, vc, table, _, _ = prompt_case(400, 9, 3, 64, 16, seed=5)
    d = 64
    alone = torch.empty(1, 9 * d, dtype=torch.bfloat16)
    kernel(alone, q[390:391], kc, vc, table, torch.tensor([[0, 1, 390]]), d**-0.5, 0.0, 0)
    # Rows: three decode rows over the same blocks, then a chunk of 20 over the first 300 tokens.
    qs = torch.cat([q[390:391], q[250:251], q[399:400], q[300:320]])
    info = torch.tensor([[0, 1, 390], [1, 2, 250], [2, 3, 399], [3, 23, 300]])
    out = torch.empty(23, 9 * d, dtype=torch.bfloat16)
    kernel(out, qs, kc, vc, table.repeat(4, 1), info, d**-0.5, 0.0, 0)
    assert torch.equal(out[0:1], alone)
    chunks = run_chunks(kernel, q, kc, vc, table, [0, 300, 320, 400])
    assert torch.equal(out[3:23], chunks[300:320])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@needs_lanes
@PAGED_KERNELS
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [0, 70])
def test_an_8_bit_cache_gives_a_query_the_same_bits_however_it_is_grouped(
    heads, kv_heads, head_dim, name, kernel, window
):
    """An 8-bit cache (int8: integer dot products; on the build's widest tiles and on the
    256-bit ones): a 300-token prompt in one call, chunk by chunk, every position as a decode
    row in one call (cascades, and enough rows that a work unit takes all KV heads on up to 18
    threads) and some rows alone: the same bits, within bf16 rounding of fp64 attention over
    the dequantized K/V."""
    q, kc, vc, table, _, _ = prompt_case(300, heads, kv_heads, head_dim, 16, seed=3)
    fmt = kv_format(name, torch.bfloat16)
    kq, vq = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    whole = run_chunks(kernel, q, kq, vq, table, [0, 300], window)
    cuts = [0, 63, 64, 129, 200, 300]
    assert torch.equal(whole, run_chunks(kernel, q, kq, vq, table, cuts, window))
    assert torch.equal(whole, run_decode_rows(q, kq, vq, table, window, kernel))
    for p in (0, 63, 64, 150, 299):
        alone = run_chunks(kernel, q, kq, vq, table, [p, p + 1], window)[p : p + 1]
        assert torch.equal(whole[p : p + 1], alone)
    slots = (table[0].long().unsqueeze(1) * 16 + torch.arange(16)).view(-1)[:300]
    rows = kq.shape[-1]
    keys = dequantize_rows(kq.view(-1, kv_heads, rows)[slots], fmt, torch.float64)
    values = dequantize_rows(vq.view(-1, kv_heads, rows)[slots], fmt, torch.float64)
    assert (whole.double() - exact(q, keys, values, window)).abs().max().item() < 0.02


@needs_lanes
@PAGED_KERNELS
@pytest.mark.parametrize("head_dim", [64, 256])
def test_int8_sums_at_their_largest_stay_exact(kernel, head_dim):
    """Every int8 code at +-127 and a query of one magnitude (its int16 copy at +-32767), some
    keys equal to the query's signs: the integer score sums reach 32767 * 127 * head_dim (~2^30
    at 256 dims) and the value sums their largest too; the output stays within bf16 rounding
    of fp64 attention over the dequantized K/V (an int32 overflow would not)."""
    g = torch.Generator().manual_seed(11)
    length, heads, kv_heads = 70, 2, 1
    q, kc, vc, table, _, _ = prompt_case(length, heads, kv_heads, head_dim, 16, seed=5)
    signs = lambda t: torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    q = signs(q).bfloat16()
    kc, vc = signs(kc).bfloat16(), signs(vc).bfloat16()
    slots = (table[0].long().unsqueeze(1) * 16 + torch.arange(16)).view(-1)[:length]
    flat = kc.view(-1, kv_heads, head_dim)
    flat[slots[::3]] = q[::3, :1].float().sign().bfloat16()  # keys aligned with their query
    fmt = kv_format("int8", torch.bfloat16)
    kq, vq = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    assert kq[..., :head_dim].abs().min().item() == 127
    out = run_chunks(kernel, q, kq, vq, table, [0, length])
    rows = kq.shape[-1]
    keys = dequantize_rows(kq.view(-1, kv_heads, rows)[slots], fmt, torch.float64)
    values = dequantize_rows(vq.view(-1, kv_heads, rows)[slots], fmt, torch.float64)
    assert (out.double() - exact(q, keys, values)).abs().max().item() < 0.02


@needs_lanes
@PAGED_KERNELS
def test_a_nan_scale_in_an_int8_row_the_query_cannot_see_stays_out(kernel):
    """A NaN scale in the K and V rows of a slot after the query's position, in the same
    64-key tile (a corrupted unwritten tail): the rows before it get the clean cache's bits."""
    q, kc, vc, table, _, _ = prompt_case(40, 9, 3, 64, 16, seed=7)
    fmt = kv_format("int8", torch.bfloat16)
    kq, vq = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    clean = run_chunks(kernel, q, kq, vq, table, [0, 40])
    slot = table[0, 30 // 16].item(), 30 % 16
    nan = torch.tensor([float("nan")]).view(torch.int8)
    kq[slot][:, 64:] = nan
    vq[slot][:, 64:] = nan
    out = run_chunks(kernel, q, kq, vq, table, [0, 40])
    assert torch.equal(out[:30], clean[:30])
    decode = run_decode_rows(q, kq, vq, table, fn=kernel)
    assert torch.equal(decode[:30], clean[:30])


@needs_lanes
@PAGED_KERNELS
def test_a_nan_in_a_key_the_query_cannot_see_stays_out(kernel):
    """A NaN key and value in a slot after the query's position (a block's unwritten tail, in
    the same 64-key tile) does not reach the output; one it can see does."""
    q, kc, vc, table, _, _ = prompt_case(40, 9, 3, 64, 16, seed=7)
    slot = table[0, 30 // 16].item(), 30 % 16
    kc[slot] = float("nan")
    vc[slot] = float("nan")
    out = torch.empty(40, 9 * 64, dtype=torch.bfloat16)
    kernel(out, q, kc, vc, table, torch.tensor([[0, 40, 0]]), 0.125, 0.0, 0)
    assert not out[:30].isnan().any()
    assert out[30:].isnan().all()


@needs_lanes
def test_the_paged_kernel_keeps_its_portable_path_for_soft_capping():
    """Soft-capping has no lanes path: the call falls back to the portable one (the same bits
    as asking for it), still matching the reference."""
    q, kc, vc, table, _, _ = prompt_case(50, 4, 2, 64, 16, seed=9)
    a = run_chunks(paged, q, kc, vc, table, [0, 50], softcap=5.0)
    b = run_chunks(portable, q, kc, vc, table, [0, 50], softcap=5.0)
    assert torch.equal(a, b)
    assert math.isfinite(a.float().abs().max().item())


def test_a_native_build_has_the_widest_tiles_its_cpu_can_run():
    """Where the kernels are built for this CPU, one with AVX512-BF16 and VNNI gets the 512-bit
    tiles and the long-chunk kernel, and one with AVX2 and FMA at least the 256-bit tiles (the
    tests that compare the paths would otherwise pass on a fallback without comparing)."""
    if paged is None or kernel_march() != "native":
        pytest.skip("the kernels are not built for this CPU here")
    flags = set(cpuinfo().get("flags", "").split())
    if {"avx512_bf16", "avx512_vnni"} <= flags:
        assert lanes_width == 512
        assert prefill is not None
    elif {"avx2", "fma"} <= flags:
        assert lanes_width == 256


@pytest.mark.skipif(lanes_width == 0, reason="this build has no keys-in-lanes tiles")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [*SHAPES, (8, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("name", ["bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [0, 100])
def test_the_256_bit_tiles_give_the_512_bit_tiles_bits(heads, kv_heads, head_dim, name, window):
    """Each KV dtype on the AVX2 tiles (VDPBF16PS as two FMAs under FTZ/DAZ, int8 as int16
    pairs, the softmax in 8-lane halves) and on the build's widest (the AVX-512 ones where it
    has them; on an AVX2 build, that the kernel serves the call from the 256-bit tiles): the
    same bits for a prompt in chunks, a decode batch over a shared prefix (cascades) and rows
    at tile edges, so an engine's cache is one namespace for both kinds of host."""
    q, kc, vc, table, _, _ = prompt_case(260, heads, kv_heads, head_dim, 16, seed=13)
    if name != "bf16":
        fmt = kv_format(name, torch.bfloat16)
        kc, vc = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    for cuts in ([0, 260], [0, 1, 63, 64, 65, 200, 260]):
        wide = run_chunks(paged, q, kc, vc, table, cuts, window)
        assert torch.equal(wide, run_chunks(paged_avx2, q, kc, vc, table, cuts, window))
    wide = run_decode_rows(q, kc, vc, table, window)
    assert torch.equal(wide, run_decode_rows(q, kc, vc, table, window, paged_avx2))


@pytest.mark.skipif(lanes_width == 0, reason="this build has no keys-in-lanes tiles")
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3"])
def test_subnormal_queries_and_keys_give_the_512_bit_tiles_bits(name):
    """VDPBF16PS reads subnormal inputs as zero and flushes subnormal results: the 256-bit
    tiles' FMAs run under DAZ and FTZ for the scores. Queries and keys of subnormal magnitude
    (and products that underflow) give the widest tiles' bits on both widths."""
    q, kc, vc, table, _, _ = prompt_case(150, 4, 2, 64, 16, seed=21)
    tiny = torch.tensor(1e-39).bfloat16()  # subnormal in bf16 and fp32
    q = torch.where(torch.arange(q.numel()).view(q.shape) % 3 == 0, q * tiny, q)
    kc = torch.where(torch.arange(kc.numel()).view(kc.shape) % 5 == 0, kc * tiny, kc)
    kc[0] = float("nan")
    assert ((q.float().abs() < 1.2e-38) & (q != 0)).any()  # nonzero subnormals
    if name != "bf16":
        fmt = kv_format(name, torch.bfloat16)
        kc, vc = quantize_rows(kc, fmt), quantize_rows(vc, fmt)
    wide = run_chunks(paged, q, kc, vc, table, [0, 150])
    assert torch.equal(wide, run_chunks(paged_avx2, q, kc, vc, table, [0, 150]))
    assert torch.equal(wide, run_decode_rows(q, kc, vc, table, fn=paged_avx2))


@pytest.mark.skipif(lanes_width == 0, reason="this build has no keys-in-lanes tiles")
def test_the_tiles_leave_the_callers_denormals_as_they_were():
    """The 256-bit tiles set FTZ and DAZ only around their score loops: after a call, on the
    calling thread and on torch's worker threads, a product that underflows is still a
    subnormal, not zero."""
    q, kc, vc, table, _, _ = prompt_case(150, 4, 2, 64, 16, seed=22)
    run_chunks(paged_avx2, q, kc, vc, table, [0, 150])
    run_decode_rows(q, kc, vc, table, fn=paged_avx2)
    small = torch.full((1 << 20,), 1e-30)  # many elements: torch's threads take part
    product = small * small.new_full((1,), 1e-10)
    assert (product > 0).all()
    assert product[0].item() < 1.2e-38
