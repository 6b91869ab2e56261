"""The bf16 Linear's fast paths: oneDNN-packed bf16, the streaming kernel for a few rows, and
(on the kinds of CPU whose row of cpu_paths.CPU_TABLE says so: AVX2 only, or Intel without AMX
where the native GEMM is unavailable) an fp32 copy of the weight for batches of FP32_MIN_ROWS
rows or more. The tests of those paths run with the native GEMM off (`no_native_gemm`); the
native GEMM's own are in test_native_gemm.py."""

import pytest
import torch
import torch.nn.functional as F

from prefixserve.model.kernels import cpu_paths
from prefixserve.model.layers import kernel_table
from prefixserve.model.layers import linear as layers
from prefixserve.model.layers.linear import FP32_MIN_ROWS, Linear


@pytest.fixture(autouse=True)
def no_native_gemm(monkeypatch):
    """These paths are what a CPU without the native GEMM takes (or this one with
    PREFIXSERVE_NATIVE_GEMM=0)."""
    monkeypatch.setitem(kernel_table._kernels, "gemm", None)


def make_linear(bias=True):
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=bias).to(torch.bfloat16)
    lin.pack()
    return lin


def test_large_batches_compute_in_fp32_and_round_back_to_bf16(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "1")
    lin = make_linear()
    x = torch.randn(FP32_MIN_ROWS, 64).to(torch.bfloat16)
    out = lin(x)
    assert out.dtype == torch.bfloat16
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    assert torch.equal(out, want)


def test_bf16_weights_are_packed_wherever_the_cpu_has_avx512():
    """The probe must not turn packing off where oneDNN supports it (torch's AVX512 capability
    means avx512f/bw/vl/dq, what oneDNN's bf16 reorder needs); AVX2-only CPUs refuse it."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 here: packing may be unavailable")
    assert layers.bf16_packing_supported()
    lin = make_linear()
    assert lin._packed is not None


@pytest.mark.skipif(
    not layers.bf16_packing_supported(), reason="oneDNN cannot pack bf16 on this CPU (AVX2 only)"
)
def test_small_batches_stay_on_the_packed_bf16_path(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "1")
    lin = make_linear()
    calls = []
    real_linear = layers.F.linear

    def spy(x, *args):
        calls.append((x.shape[0], x.dtype))
        return real_linear(x, *args)

    monkeypatch.setattr(layers.F, "linear", spy)
    small = torch.randn(FP32_MIN_ROWS - 1, 64).to(torch.bfloat16)
    out = lin(small)
    torch.testing.assert_close(out, real_linear(small, lin.weight, lin.bias), atol=0.05, rtol=0.02)
    assert calls == []  # the oneDNN-packed kernel, not F.linear
    lin(torch.randn(FP32_MIN_ROWS, 64).to(torch.bfloat16))
    assert calls == [(FP32_MIN_ROWS, torch.float32)]


def test_fp32_copy_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "0")
    lin = make_linear(bias=False)
    assert lin._fp32 is None
    x = torch.randn(2 * FP32_MIN_ROWS, 64).to(torch.bfloat16)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=0.05, rtol=0.02)


def use_kind(monkeypatch, kind):
    monkeypatch.setattr(layers, "cpu_paths_here", lambda: cpu_paths.CPU_TABLE[kind])


def test_fp32_copy_follows_the_cpu_when_not_forced(monkeypatch):
    """Where the native GEMM is unavailable (no_native_gemm)."""
    monkeypatch.delenv("PREFIXSERVE_FP32_PREFILL", raising=False)
    for kind in ("amx", "avx512_bf16_amd"):  # bf16 GEMMs are the fast ones
        use_kind(monkeypatch, kind)
        assert make_linear()._fp32 is None, kind
    for kind in ("avx512_bf16_intel", "avx2"):
        use_kind(monkeypatch, kind)
        assert make_linear()._fp32 is not None, kind


def test_the_cpu_kind_picks_its_row_of_the_gemm_table(monkeypatch):
    def cpu(amx, packing, bf16, vendor):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(cpu_paths, "bf16_packing_supported", lambda: packing)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(cpu_paths, "cpu_vendor", lambda: vendor)
        return cpu_paths.cpu_kind()

    assert cpu(True, True, True, "GenuineIntel") == "amx"
    assert cpu(False, True, True, "AuthenticAMD") == "avx512_bf16_amd"
    assert cpu(False, True, True, "GenuineIntel") == "avx512_bf16_intel"
    assert cpu(False, True, True, "") == "avx512_bf16_intel"
    assert cpu(False, True, False, "AuthenticAMD") == "avx512"
    assert cpu(False, False, False, "AuthenticAMD") == "avx2"
    monkeypatch.setattr(cpu_paths.platform, "machine", lambda: "aarch64")
    assert cpu(False, False, False, "") == "portable"  # no x86 row for another architecture


def test_this_cpu_has_a_row_with_its_measurement_and_attention_follows_it():
    from prefixserve.model.layers import attention

    path = cpu_paths.cpu_paths_here()
    assert path.measured
    assert path.fp32_min_rows is None or path.fp32_min_rows >= 1
    assert attention.KERNEL_MAX_QUERIES == path.kernel_max_queries >= 2


def test_fp32_linears_are_never_made_for_fp32_weights(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "1")
    lin = Linear(8, 8)
    lin.pack()
    assert lin._fp32 is None and lin._packed is None


def test_lm_head_keeps_an_fp32_copy_only_where_bf16_is_plain_f_linear(default_model_bf16):
    model = default_model_bf16.model
    if model.lm_head._gemm is not None:
        pytest.skip("the native GEMM takes every bf16 linear here (test_native_gemm.py)")
    if not layers._fp32_large_batches():
        pytest.skip("this CPU computes large bf16 batches in bf16")
    assert model.model.layers[0].mlp.gate_up_proj._fp32 is not None
    # AVX-512: oneDNN's packed bf16 head is fast enough; AVX2: fp32 from 16 rows on
    assert (model.lm_head._fp32 is not None) == cpu_paths.cpu_paths_here().lm_head_fp32


def test_the_fp32_row_threshold_follows_the_cpu(monkeypatch):
    use_kind(monkeypatch, "avx512_bf16_intel")
    assert layers._fp32_min_rows() == 64
    use_kind(monkeypatch, "avx2")
    assert layers._fp32_min_rows() == 16
    # a row without an fp32 copy, forced on by PREFIXSERVE_FP32_PREFILL=1: by packing
    use_kind(monkeypatch, "avx512_bf16_amd")
    monkeypatch.setattr(layers, "bf16_packing_supported", lambda: True)
    assert layers._fp32_min_rows() == 64
    monkeypatch.setattr(layers, "bf16_packing_supported", lambda: False)
    assert layers._fp32_min_rows() == 16


def test_a_vocabulary_sized_lm_head_keeps_no_fp32_copy(monkeypatch):
    use_kind(monkeypatch, "avx2")
    monkeypatch.setattr(layers, "_fp32_large_batches", lambda: True)
    small = torch.nn.Linear(64, 1024, bias=False, device="meta")
    big = torch.nn.Linear(640, 262_144, bias=False, device="meta")  # Gemma 3's head
    assert layers.lm_head_fp32_copy(small) and not layers.lm_head_fp32_copy(big)
    use_kind(monkeypatch, "avx512_bf16_intel")
    assert not layers.lm_head_fp32_copy(small)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "in_features,out_features", [(64, 48), (100, 37), (576, 960), (33, 5), (64, 4099)]
)
def test_few_rows_stream_through_the_native_kernel_with_one_rounding(
    monkeypatch, threads, bias, in_features, out_features
):
    """Batches of up to STREAM_MAX_ROWS rows: fp32 sums of the bf16 products rounded once, so
    every output is within half a bf16 ulp (plus fp32 summation order) of the exact result; the
    K tails that are no multiple of the vector width (100, 33) are masked, not read past; the
    rows split over the kernel's helper threads (4,099 outputs: many chunks, a short last one)
    are each computed once."""
    kernel = kernel_table._kernel("linear_small")
    if kernel is None:
        pytest.skip("native kernels unavailable")
    calls = []

    def spy(*args):
        calls.append((args[1].shape[0], args[4]))
        return kernel(*args)

    monkeypatch.setitem(kernel_table._kernels, "linear_small", spy)
    torch.manual_seed(1)
    lin = Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    lin.pack()
    monkeypatch.setattr(layers, "STREAM_THREADS", [threads])
    for rows in range(1, layers.STREAM_MAX_ROWS + 1):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        out = lin(x)
        exact = F.linear(
            x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
        )
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
        assert ((out.double() - exact).abs() <= ulp + 1e-4 * in_features).all()
    assert calls == [(rows, threads) for rows in range(1, layers.STREAM_MAX_ROWS + 1)]
    lin(torch.randn(layers.STREAM_MAX_ROWS + 1, in_features).to(torch.bfloat16))
    assert len(calls) == layers.STREAM_MAX_ROWS  # more rows: oneDNN's GEMM


def test_the_stream_kernel_refuses_what_it_cannot_compute():
    kernel = kernel_table._kernel("linear_small")
    if kernel is None:
        pytest.skip("native kernels unavailable")
    w = torch.randn(8, 16).to(torch.bfloat16)
    x = torch.randn(2, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="shapes"):
        kernel(torch.empty(2, 8, dtype=torch.bfloat16), torch.randn(2, 15).bfloat16(), w, None, 1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(torch.empty(2, 8), x.float(), w.float(), None, 1)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(
            torch.empty(2, 8, dtype=torch.bfloat16), x, w, torch.zeros(7, dtype=torch.bfloat16), 1
        )


def _stream(kernel, x, w, threads):
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    kernel(out, x, w, None, threads)
    return out


def _stream_in_child(x, w, threads):
    return _stream(kernel_table._kernel("linear_small"), x, w, threads)


def test_the_stream_pool_serves_concurrent_callers_and_forked_children():
    """Two threads streaming at once (the second runs its job alone) and a child forked after
    the helpers started (it has none: its caller does every chunk) get exact results."""
    import multiprocessing
    import threading

    kernel = kernel_table._kernel("linear_small")
    if kernel is None:
        pytest.skip("native kernels unavailable")
    torch.manual_seed(2)
    w = torch.randn(4096, 256).to(torch.bfloat16)
    xs = [torch.randn(2, 256).to(torch.bfloat16) for _ in range(4)]
    want = [_stream(kernel, x, w, 1) for x in xs]
    results: dict[int, list[torch.Tensor]] = {}

    def worker(i: int) -> None:
        results[i] = [_stream(kernel, xs[i], w, 2) for _ in range(50)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert all(torch.equal(r, want[i]) for r in results[i])

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply_async(_stream_in_child, (xs[0], w, 2)).get(timeout=60)
    assert torch.equal(child, want[0])


def test_the_stream_pool_stays_exact_when_its_helpers_get_no_core():
    """A busy thread beside a two-thread stream (the kernel releases the GIL, so the busy loop
    takes a core): whether the pool's helpers keep up, stall or the pool steps back to the
    caller alone, every result is the one-thread one."""
    import threading
    import time

    kernel = kernel_table._kernel("linear_small")
    if kernel is None:
        pytest.skip("native kernels unavailable")
    torch.manual_seed(3)
    w = torch.randn(8192, 128).to(torch.bfloat16)
    x = torch.randn(3, 128).to(torch.bfloat16)
    want = _stream(kernel, x, w, 1)
    stop = time.monotonic() + 1.0

    def busy() -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1

    burner = threading.Thread(target=busy)
    burner.start()
    try:
        while time.monotonic() < stop:
            assert torch.equal(_stream(kernel, x, w, 2), want)
    finally:
        burner.join()
