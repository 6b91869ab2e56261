"""bf16 vs fp32 GEMMs on this CPU, at the default model's linear shapes, by batch rows.

    .venv/bin/python benchmarks/bench_gemm.py [--rows 8,16,32,64,128,256,512,2048] [--native]
        [--families]

For each (in, out) shape and row count M: the bf16 linear the model uses for small batches
(oneDNN-packed where this CPU can pack bf16 weights, plain `F.linear` in bf16 elsewhere, as
`prefixserve.model.layers.linear.Linear` chooses), against `F.linear` in fp32 from an fp32 copy
of the weight (input cast up, output cast back to bf16, as `Linear` does for batches of its fp32
row threshold or more). Prints GFLOP/s of each and the ratio; median of 7 repeats of >= 50 ms
each.

`--native` adds the native GEMM (csrc/linear/gemm_bf16.cpp: one summation order at every row count,
on the tile families the host's calibration chose, printed first) and, for up to 16 rows, the
streaming kernel (csrc/linear/gemv.cpp), both on as many threads as torch has, and the native GEMM's
ratio to the best of the others. `--families` (with `--native`) adds the native GEMM on each
tile family that runs here (the same sums: AVX-512 FMAs, bf16 dot products, AVX2 FMAs), as
GFLOP/s.

First it prints this host's GEMM peak: a 2,048-cube matmul in bf16 (oneDNN) and in fp32, the
reference against which the model's prefill is stated (BENCHMARKS.md, "Model speed").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prefixserve.model.kernels.build import (  # noqa: E402
    _module,
    linear_bf16_packed_kernels,
    linear_bf16_small_kernel,
)
from prefixserve.model.kernels.calibration import describe_calibration  # noqa: E402
from prefixserve.model.kernels.cpu_paths import bf16_packing_supported, describe_cpu  # noqa: E402

# (in_features, out_features) of SmolLM2-135M's fused qkv, o, gate_up and down projections.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LM_HEAD = (576, 49152)


def seconds(fn) -> float:
    fn()
    samples = []
    for _ in range(7):
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            fn()
            n += 1
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def gemm_peaks(size: int = 2048) -> dict[str, float]:
    """GFLOP/s of a size-cube matmul in bf16 and in fp32 (median of `seconds`)."""
    peaks = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        peaks[str(dtype).removeprefix("torch.")] = (
            2 * size**3 / seconds(lambda a=a, b=b: a @ b) / 1e9
        )
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,32,64,128,256,512,2048")
    ap.add_argument(
        "--lm-head-rows",
        default="",
        help="also the LM head's shape (576 x 49152) at these rows, e.g. 1,8,16",
    )
    ap.add_argument(
        "--native",
        action="store_true",
        help="also the native GEMM and (up to 16 rows) the streaming kernel",
    )
    ap.add_argument(
        "--families",
        action="store_true",
        help="with --native: also the native GEMM on each tile family that runs here",
    )
    args = ap.parse_args()
    native = linear_bf16_packed_kernels() if args.native else None
    if args.native and native is None:
        raise SystemExit("--native: the native kernels are unavailable here (see the warning)")
    rows = [int(r) for r in args.rows.split(",")]
    packing = bf16_packing_supported()
    print(describe_cpu())
    families = list(_module().gemm_bf16_families()) if native and args.families else []
    if native:
        print(describe_calibration())
    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | AMX "
        f"{torch.cpu._is_amx_tile_supported()} | bf16 packing {packing} | load avg "
        f"{os.getloadavg()[0]:.1f}"
    )
    with torch.inference_mode():
        for name, peak in gemm_peaks().items():
            print(f"GEMM peak {name}: {peak:.0f} GFLOP/s (2048 x 2048 x 2048)")
    kind = "packed" if packing else "F.linear"
    head = f"| shape (in x out) | rows | bf16 {kind} GFLOP/s | fp32 GFLOP/s | fp32 speed-up |"
    rule = "|---|---:|---:|---:|---:|"
    if native:
        head += " native GEMM GFLOP/s | streaming GFLOP/s | native / best other |"
        rule += "---:|---:|---:|"
        for family in families:
            head += f" {family} tiles GFLOP/s |"
            rule += "---:|"
    print(head)
    print(rule)
    cases = [(shape, rows) for shape in SHAPES]
    if args.lm_head_rows:
        cases.append((LM_HEAD, [int(r) for r in args.lm_head_rows.split(",")]))
    with torch.inference_mode():
        for (k, n), case_rows in cases:
            w = torch.randn(n, k).bfloat16()
            w32 = w.float()
            if packing:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)

                def bf16(x, p=packed):
                    return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            else:

                def bf16(x, w=w):
                    return F.linear(x, w)

            for m in case_rows:
                x = torch.randn(m, k).bfloat16()
                t16 = seconds(lambda x=x, f=bf16: f(x))
                t32 = seconds(lambda x=x, w=w32: F.linear(x.float(), w).to(torch.bfloat16))
                flops = 2 * m * k * n
                line = (
                    f"| {k} x {n} | {m} | {flops / t16 / 1e9:.0f} | {flops / t32 / 1e9:.0f} "
                    f"| {t16 / t32:.2f}x |"
                )
                if native:
                    line += native_cells(native, w, x, t16, t32, flops, families)
                print(line)


def native_cells(native, w, x, t16: float, t32: float, flops: int, families: list[str]) -> str:
    """The --native (and --families) columns for one shape and row count."""
    pack, run = native[0], native[1]
    m, n = x.shape[0], w.shape[0]
    threads = torch.get_num_threads()
    packed, out = pack(w), torch.empty(m, n, dtype=torch.bfloat16)
    t_native = seconds(lambda: run(out, x, packed, n, None, threads))
    t_stream = float("inf")
    stream = linear_bf16_small_kernel()
    if m <= 16 and stream is not None:
        t_stream = seconds(lambda: stream(out, x, w, None, threads))
    stream_cell = f"{flops / t_stream / 1e9:.0f}" if t_stream != float("inf") else "-"
    best = min(t16, t32, t_stream)
    cells = f" {flops / t_native / 1e9:.0f} | {stream_cell} | {best / t_native:.2f}x |"
    run_on = _module().linear_bf16_packed_on
    for family in families:
        t_family = seconds(lambda f=family: run_on(out, x, packed, n, None, threads, f))
        cells += f" {flops / t_family / 1e9:.0f} |"
    return cells


if __name__ == "__main__":
    main()
