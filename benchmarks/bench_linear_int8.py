"""The 8-, 5- and 4-bit weight kernel alone (`linear_int8`, csrc/linear/linear_int8.cpp) at batch 1:
microseconds per call and GB/s of weight bytes, per format, for the default model's shapes
(gate_up 3,072 x 576 from cache, the 49,152 x 576 LM head from memory), on the build this
process loads (`PREFIXSERVE_KERNEL_MARCH=x86-64-v3` times the AVX2 build on an AVX-512 host).
Random codes; the median of `--repeats` calls after a warm-up.

    .venv/bin/python benchmarks/bench_linear_int8.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from prefixserve.model.kernels.build import linear_int8_kernel
from prefixserve.model.quant.weights import LOW_BIT_FORMATS, Int8Weight, packed_weight

SHAPES = {"gate_up 3072x576": (3072, 576), "head 49152x576": (49152, 576)}
FORMATS = ("q8_0", "q5_0", "q4_0", "q4_k")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def weight(n: int, k: int, fmt: str) -> Int8Weight:
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(n, k // 32, generator=gen) * 1e-3
    if fmt == "q8_0":
        return Int8Weight(
            torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scales, fmt
        )
    if fmt == "q4_k":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
        return Int8Weight(codes, scales, fmt, torch.rand(n, k // 32, generator=gen) * 1e-3)
    zero = 1 << (LOW_BIT_FORMATS[fmt] - 1)
    return Int8Weight(
        torch.randint(-zero, zero, (n, k), generator=gen, dtype=torch.int8), scales, fmt
    )


def time_call(n: int, k: int, fmt: str, threads: int, repeats: int) -> tuple[float, int]:
    codes, scales = packed_weight(weight(n, k, fmt))
    x = torch.randn(1, k).bfloat16()
    out = torch.empty(1, n, dtype=torch.bfloat16)
    kernel = linear_int8_kernel()
    for _ in range(5):
        kernel(out, x, codes, scales, None, 0, None, threads)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(out, x, codes, scales, None, 0, None, threads)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), codes.nbytes + scales.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    if linear_int8_kernel() is None:
        raise SystemExit("the kernels are not built on this host")
    cpuinfo = Path("/proc/cpuinfo").read_text()
    print(f"# flags: {' '.join(f for f in FLAGS if f in cpuinfo)}; threads {args.threads}")
    print("| shape | " + " | ".join(f"{f} us (GB/s)" for f in FORMATS) + " |")
    print("|---|" + "---:|" * len(FORMATS))
    for name, (n, k) in SHAPES.items():
        cells = []
        for fmt in FORMATS:
            seconds, nbytes = time_call(n, k, fmt, args.threads, args.repeats)
            cells.append(f"{seconds * 1e6:.1f} ({nbytes / seconds / 1e9:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
