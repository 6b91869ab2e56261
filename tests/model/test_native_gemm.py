"""The native bf16 GEMM (csrc/linear/gemm_bf16.cpp): one summation order per output at every row
count,
against float64 with error bounds, and the Linear's use of it where the CPU table takes it."""

import pytest
import torch
import torch.nn.functional as F

from prefixserve.model.kernels import build, cpu_paths
from prefixserve.model.layers import common, kernel_table, linear
from prefixserve.model.layers.linear import Linear

KERNELS = build.linear_bf16_packed_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native kernels unavailable")


def gemm(x, packed, n, bias=None, threads=2):
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    KERNELS[1](out, x, packed, n, bias, threads)
    return out


def within_bf16_rounding(out, x, w, bias):
    """Every output within half a bf16 ulp of the exact sum, plus fp32 summation error."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
    fp32_sums = 1e-6 * x.shape[1] * (x.double().abs() @ w.double().abs().T)
    return bool(((out.double() - exact).abs() <= ulp + fp32_sums).all())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k,n", [(64, 48), (577, 33), (576, 960), (3, 5), (1536, 4099)])
def test_the_native_gemm_matches_float64_within_one_rounding(bias, k, n):
    """Odd K (a zero pad pair), N no multiple of the 32-column panel (masked stores), every tile
    height from 1 to 12 rows, a few blocks of 12, and 130 rows (at the largest shape several row
    ranges over every panel: the large calls' jobs, taken panels outermost)."""
    torch.manual_seed(k + n)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = KERNELS[0](w)
    for rows in (1, 2, 3, 4, 5, 7, 12, 13, 25, 40, 130):
        x = torch.randn(rows, k).bfloat16()
        assert within_bf16_rounding(gemm(x, packed, n, b), x, w, b), rows


def test_a_rows_result_never_depends_on_the_other_rows_or_the_threads():
    """Batch-invariant by itself: each row of calls of 1 to 70 rows, taken from anywhere in a
    70-row batch, on 1, 2 or 3 threads, is bit for bit that row in the 70-row call (tiles of
    1-12 rows, 1, 2 or 4 panels at once, row ranges split over the stream pool's jobs)."""
    torch.manual_seed(4)
    k, n = 640, 200
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16()
    packed = KERNELS[0](w)
    x = torch.randn(70, k).bfloat16()
    full = gemm(x, packed, n, b, threads=2)
    for rows in (1, 2, 3, 5, 6, 9, 12, 13, 24, 31, 70):
        for start in sorted({0, (70 - rows) // 2, 70 - rows}):
            for threads in (1, 2, 3):
                part = gemm(x[start : start + rows].contiguous(), packed, n, b, threads)
                assert torch.equal(part, full[start : start + rows]), (rows, start, threads)


def test_the_native_gemm_keeps_nan_and_infinity():
    w = torch.ones(40, 8).bfloat16()
    packed = KERNELS[0](w)
    x = torch.zeros(2, 8).bfloat16()
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    out = gemm(x, packed, 40)
    assert out[0].isnan().all() and (out[1] == float("inf")).all()


def test_the_native_gemm_refuses_what_it_cannot_compute():
    w = torch.randn(40, 16).bfloat16()
    packed = KERNELS[0](w)
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="pack_bf16_gemm"):
        gemm(torch.randn(2, 18).bfloat16(), packed, 40)  # another K
    with pytest.raises(RuntimeError, match="pack_bf16_gemm"):
        gemm(x, packed, 80)  # another N
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS[1](torch.empty(2, 40), x.float(), packed, 40, None, 1)
    with pytest.raises(RuntimeError, match="bias"):
        gemm(x, packed, 40, torch.zeros(39).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS[0](w.float())
    assert gemm(torch.empty(0, 16).bfloat16(), packed, 40).shape == (0, 40)


def unfused_gated(x, packed, two_i, bias, act):
    """The gated MLP's first half as separate bf16 ops over the plain native GEMM."""
    gate, up = gemm(x, packed, two_i, bias).split(two_i // 2, dim=-1)
    return common._ACTIVATIONS[act](gate) * up


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_gated_epilogue_is_the_separate_ops_within_their_roundings(bias, act):
    """act(gate) * up in the epilogue: the same gate and up sums as the plain call, each step
    rounded to bf16 as the separate ops round it. SiLU came out bit for bit PyTorch's here; the
    tanh GELU uses g * sigmoid(2y) (no cancellation for negative inputs), so each output is
    within a bf16 rounding of |gate * up| of the float64 result, as PyTorch's own."""
    if not build.gemm_bf16_vectorized():
        pytest.skip("the gated epilogue is built with AVX-512 only")
    torch.manual_seed(6)
    k, half = 200, 96
    w = (torch.randn(2 * half, k) * 0.3).bfloat16()
    b = torch.randn(2 * half).bfloat16() if bias else None
    packed = KERNELS[0](w)
    for rows in (1, 2, 5, 6, 7, 13, 40):
        x = torch.randn(rows, k).bfloat16()
        out = torch.empty(rows, half, dtype=torch.bfloat16)
        KERNELS[2](out, x, packed, 2 * half, b, common.GATED_ACTS[act], 2)
        gate, up = gemm(x, packed, 2 * half, b).split(half, dim=-1)
        exact = common._ACTIVATIONS[act](gate.double()).bfloat16().double() * up.double()
        scale = (gate.double().abs() * up.double().abs()).clamp_min(1e-30)
        assert ((out.double() - exact).abs() <= scale * 2**-8 + 1e-30).all(), rows
        if act == "silu":
            assert torch.equal(out, unfused_gated(x, packed, 2 * half, b, act)), rows
        alone = torch.empty(1, half, dtype=torch.bfloat16)
        KERNELS[2](alone, x[-1:].contiguous(), packed, 2 * half, b, common.GATED_ACTS[act], 1)
        assert torch.equal(alone, out[-1:])  # batch-invariant as the plain call


def test_the_gated_epilogue_refuses_what_it_cannot_compute():
    if not build.gemm_bf16_vectorized():
        pytest.skip("the gated epilogue is built with AVX-512 only")
    packed = KERNELS[0](torch.randn(96, 16).bfloat16())
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 64"):
        KERNELS[2](torch.empty(2, 48, dtype=torch.bfloat16), x, packed, 96, None, 1, 1)
    packed = KERNELS[0](torch.randn(128, 16).bfloat16())
    with pytest.raises(RuntimeError, match="act 1 or 2"):
        KERNELS[2](torch.empty(2, 64, dtype=torch.bfloat16), x, packed, 128, None, 3, 1)
    with pytest.raises(RuntimeError, match="rows, 64"):
        KERNELS[2](torch.empty(2, 128, dtype=torch.bfloat16), x, packed, 128, None, 1, 1)


@pytest.fixture
def native_linear(monkeypatch):
    if kernel_table._kernel("gemm") is None:
        pytest.skip("this CPU does not take the native GEMM (or its AVX-512 tiles are not built)")
    calls = []
    pack, run, gated = kernel_table._kernel("gemm")

    def spy(out, x, *args):
        calls.append(x.shape[0])
        return run(out, x, *args)

    monkeypatch.setitem(kernel_table._kernels, "gemm", (pack, spy, gated))
    torch.manual_seed(5)
    lin = Linear(96, 70, bias=True).to(torch.bfloat16)
    lin.pack()
    return lin, calls


def test_every_row_count_of_a_bf16_linear_takes_the_native_gemm(native_linear, monkeypatch):
    """On a CPU whose row takes it, no other path is kept or taken: no oneDNN packed weight, no
    streaming view, no fp32 copy; 1 to 300 rows and a 3-D input all go through the kernel."""
    lin, calls = native_linear
    assert lin._packed is None and lin._stream is None and lin._fp32 is None
    for rows in (1, 3, 8, 9, 64, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert within_bf16_rounding(lin(x), x, lin.weight, lin.bias)
    out = lin(torch.randn(2, 5, 96).bfloat16())
    assert out.shape == (2, 5, 70)
    assert calls == [1, 3, 8, 9, 64, 300, 10]


def test_a_forced_fp32_copy_still_takes_large_batches(native_linear, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "1")
    lin, calls = native_linear
    lin.pack()
    assert lin._fp32 is not None
    lin(torch.randn(linear.FP32_MIN_ROWS, 96).bfloat16())
    assert calls == []
    lin(torch.randn(linear.FP32_MIN_ROWS - 1, 96).bfloat16())
    with linear.batch_invariant_linears(True):  # one path at every row count
        lin(torch.randn(linear.FP32_MIN_ROWS, 96).bfloat16())
    assert calls == [linear.FP32_MIN_ROWS - 1, linear.FP32_MIN_ROWS]


def test_the_native_gemm_runs_wherever_its_vector_tiles_do_unless_switched_off(monkeypatch):
    """No CPU table decides: every kind with AVX-512 or AVX2 tiles takes the native GEMM, the
    portable loop (a scalar loop) only when forced, and PREFIXSERVE_NATIVE_GEMM=0 turns it off."""
    monkeypatch.delenv("PREFIXSERVE_NATIVE_GEMM", raising=False)
    for tiles in ("avx512", "avx2"):
        assert cpu_paths.native_gemm_wanted(tiles), tiles
    assert not cpu_paths.native_gemm_wanted("portable")
    assert not cpu_paths.native_gemm_wanted(None)
    assert (kernel_table._native_gemm_kernels() is not None) == (
        build.gemm_bf16_tiles() in ("avx512", "avx2")
    )
    monkeypatch.setenv("PREFIXSERVE_NATIVE_GEMM", "0")
    assert not cpu_paths.native_gemm_wanted("avx512")
    assert kernel_table._native_gemm_kernels() is None
    monkeypatch.setenv("PREFIXSERVE_NATIVE_GEMM", "1")
    assert cpu_paths.native_gemm_wanted("portable")
    assert not cpu_paths.native_gemm_wanted(None)


def test_a_gated_mlp_fuses_its_activation_unless_gate_up_has_lora(monkeypatch):
    if kernel_table._kernel("gemm") is None:
        pytest.skip("this CPU does not take the native GEMM (or its AVX-512 tiles are not built)")
    torch.manual_seed(7)
    mlp = common.GatedMLP(96, 128, "silu").to(torch.bfloat16)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.pack()
    fused_calls = []
    real = mlp.gate_up_proj.gated
    monkeypatch.setattr(
        mlp.gate_up_proj, "gated", lambda x, act: fused_calls.append(act) or real(x, act)
    )
    x = torch.randn(9, 96).bfloat16()
    fused = mlp.forward(x)
    assert fused_calls == [1]
    gate, up = mlp.gate_up_proj.forward(x).split(128, dim=-1)
    assert torch.equal(fused, mlp.down_proj.forward(F.silu(gate) * up))
    mlp.gate_up_proj.lora = type("NoUpdate", (), {"apply": lambda self, x, out: None})()
    assert torch.equal(mlp.forward(x), fused)  # the unfused ops: same bits for SiLU
    assert fused_calls == [1]


def test_a_decode_sized_call_names_the_next_linears_weight_to_prefetch(default_model_bf16):
    """pack_linears chains each native Linear to the next in forward order (qkv, o, gate_up,
    down, ..., the LM head, then the first qkv again); passing the weight to prefetch changes
    no result (a hint to the stream pool's idle helpers)."""
    model = default_model_bf16.model
    if model.lm_head._gemm is None:
        pytest.skip("this CPU does not take the native GEMM")
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv_proj._next_packed is attn.o_proj._gemm[0]
    assert attn.o_proj._next_packed is mlp.gate_up_proj._gemm[0]
    assert mlp.gate_up_proj._next_packed is mlp.down_proj._gemm[0]
    assert mlp.down_proj._next_packed is model.model.layers[1].self_attn.qkv_proj._gemm[0]
    assert model.model.layers[-1].mlp.down_proj._next_packed is model.lm_head._gemm[0]
    assert model.lm_head._next_packed is attn.qkv_proj._gemm[0]
    packed, n, bias = attn.qkv_proj._gemm
    x = torch.randn(3, attn.qkv_proj.in_features).bfloat16()
    with_hint = torch.empty(3, n, dtype=torch.bfloat16)
    KERNELS[1](with_hint, x, packed, n, bias, 2, mlp.down_proj._gemm[0])
    assert torch.equal(with_hint, gemm(x, packed, n, bias))


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_the_residual_epilogue_gives_the_separate_add_bit_for_bit(rows, bias):
    """`Linear.add_to` (the residual added in the native GEMM's epilogue) against the linear
    then PyTorch's bf16 add, bit for bit, and NaN where it has NaN (its payload is c10's
    0x7fc0, PyTorch's add gives another); with LoRA attached it takes the two separate ops."""

    def same(a, b):
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(
            a[~nan].view(torch.int16), b[~nan].view(torch.int16)
        )

    torch.manual_seed(rows)
    linear = Linear(96, 72, bias=bias).to(torch.bfloat16)
    linear.pack()
    x = torch.randn(rows, 96).bfloat16()
    residual = (torch.randn(rows, 72) * 3).bfloat16()
    residual[0, 5] = float("nan")
    want = linear.forward(x).add_(residual)
    assert same(linear.add_to(x, residual), want)
    if linear._gemm is not None:  # the kernel with out as its own residual (in place)
        packed, n, b = linear._gemm
        in_place = residual.clone()
        kernel_table.compiled_kernel("gemm")[1](in_place, x, packed, n, b, 2, None, in_place)
        assert same(in_place, want)
    calls = []

    class NoUpdate:  # an adapter whose update is zero: the linear's output goes through it
        def apply(self, x_, out):
            calls.append(out.shape)

    linear.lora = NoUpdate()
    assert same(linear.add_to(x, residual), want)
    assert calls == [(rows, 72)]


def _families():
    module = build._module()
    return [] if module is None else list(module.gemm_bf16_families())


@pytest.mark.parametrize("family", _families())
@pytest.mark.parametrize("k,n", [(64, 48), (577, 33), (576, 960), (3, 5)])
def test_every_tile_family_here_gives_the_builds_tiles_bits(family, k, n):
    """Each tile family this host runs (the build's FMA tiles, AVX2's, the bf16 dot product's)
    sums each output in one order, so every output, residual add included, is the same bits
    as the selected path's, and within one rounding of float64; into an fp32 out, the same
    sums unrounded, the same bits on every family."""
    module = build._module()
    torch.manual_seed(k * n)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16()
    packed = KERNELS[0](w)
    for rows in (1, 2, 3, 4, 5, 7, 13, 40):
        x = torch.randn(rows, k).bfloat16()
        res = torch.randn(rows, n).bfloat16()
        for bias, residual in ((None, None), (b, None), (b, res)):
            got = torch.empty(rows, n, dtype=torch.bfloat16)
            module.linear_bf16_packed_on(got, x, packed, n, bias, 2, family, residual)
            if residual is None:
                assert within_bf16_rounding(got, x, w, bias), (rows, k, n)
                plain = got
            else:  # the output rounded, then the residual added and rounded: two bf16 ops
                assert torch.equal(got, plain + residual), (rows, k, n)
            own = torch.empty(rows, n, dtype=torch.bfloat16)
            KERNELS[1](own, x, packed, n, bias, 2, None, residual)
            assert torch.equal(got, own), (family, rows, k, n, bias is not None)
            if residual is None:  # an fp32 out (the LM head's logits): the same sums unrounded
                sums = torch.empty(rows, n)
                module.linear_bf16_packed_on(sums, x, packed, n, bias, 2, family)
                own_sums = torch.empty(rows, n)
                KERNELS[1](own_sums, x, packed, n, bias, 2)
                assert torch.equal(sums, own_sums) and torch.equal(sums.bfloat16(), got)
            _, _, _, prefetch, panels = module.gemm_bf16_selected()
            try:  # the decode variants (prefetch, a lone row's panels) change no sum
                module.gemm_bf16_select("", "", int(not prefetch), 6 - panels)
                other = torch.empty(rows, n, dtype=torch.bfloat16)
                module.linear_bf16_packed_on(other, x, packed, n, bias, 2, family, residual)
            finally:
                module.gemm_bf16_select("", "", int(prefetch), panels)
            assert torch.equal(other, got), (family, rows)


def test_the_families_flush_denormals_alike():
    """The dot product treats denormal inputs as zero and flushes denormal sums; the FMA
    families do the same (FlushDenormals), so a denormal weight or input cannot split them:
    1e-39 (a bf16 denormal) times 2^100 would be 1.3e-9, and is 0 on every family."""
    module = build._module()
    big, tiny = 2.0**100, 1e-39
    w = torch.tensor([[big, 0.0], [tiny, 0.0], [1.0, 1.0]]).bfloat16()
    x = torch.tensor([[tiny, 0.0], [big, 0.0], [tiny, 1.0]]).bfloat16()
    outs = []
    for family in _families():
        out = torch.empty(3, 3, dtype=torch.bfloat16)
        module.linear_bf16_packed_on(out, x, KERNELS[0](w), 3, None, 1, family, None)
        outs.append(out)
        assert out[0, 0].item() == 0.0 and out[1, 1].item() == 0.0, family
        assert out[2, 2].item() == 1.0, family
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("act", [1, 2])
def test_every_family_writes_the_gated_epilogue_with_the_same_bits(act):
    """The gated epilogue (act(gate) * up) on each family here, AVX2's and the portable loop's
    scalar one included (exp_nonpositive16's steps lane by lane), gives the AVX-512 epilogue's
    bits, for gates across the activation's range (deep negatives, where exp is tiny, too)."""
    module = build._module()
    selected = module.gemm_bf16_selected()
    torch.manual_seed(act)
    k, i = 96, 64
    w = torch.randn(2 * i, k).bfloat16()
    bias = torch.randn(2 * i).bfloat16()
    packed = KERNELS[0](w)
    x = (torch.randn(13, k) * torch.logspace(-2, 1.5, 13).unsqueeze(1)).bfloat16()
    outs = {}
    try:
        for family in _families():
            module.gemm_bf16_select(family, family)
            for rows in (1, 2, 7, 13):
                out = torch.empty(rows, i, dtype=torch.bfloat16)
                KERNELS[2](out, x[:rows].contiguous(), packed, 2 * i, bias, act, 2)
                outs.setdefault(rows, []).append((family, out))
    finally:
        module.gemm_bf16_select(selected[0], selected[1])
    for rows, results in outs.items():
        for family, out in results[1:]:
            assert torch.equal(out, results[0][1]), (family, results[0][0], rows)
        gate, up = F.linear(x[:rows], w, bias).float().chunk(2, dim=-1)
        fn = F.silu if act == 1 else (lambda g: F.gelu(g, approximate="tanh"))
        want = fn(gate.bfloat16().float()).bfloat16().float() * up.bfloat16().float()
        assert torch.allclose(results[0][1].float(), want, rtol=2e-2, atol=1e-2)
