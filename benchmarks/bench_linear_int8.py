"""The 8-, 5- and 4-bit weight kernel alone (`linear_int8`, csrc/linear/linear_int8.cpp and, for
Q4_K's super-blocks, linear_q4k.cpp): microseconds per call and GB/s of weight bytes, per format,
for the default model's shapes (gate_up 3,072 x 576 from cache, the 49,152 x 576 LM head from
memory) or a Llama-3.2-1B's (`--shapes 1b`), at batch 1 or more rows (`--rows 1,512`), on the
build this process loads (`PREFIXSERVE_KERNEL_MARCH=x86-64-v3` times the AVX2 build on an
AVX-512 host). Random codes; the median of `--repeats` calls after a warm-up. `--formats` picks
some of q8_0, q5_0, q4_0, q4_k and q6_k (super-blocks), q6_k16 (the same values as 8-bit codes
with a scale per 16: the path Q6_K took before, and takes where only its values are known); K not
a multiple of 256 skips the K-quants.

    .venv/bin/python benchmarks/bench_linear_int8.py [--threads 2] [--shapes 1b] [--rows 1,512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from prefixserve.model.kernels.build import linear_int8_kernel
from prefixserve.model.quant.weights import (
    LOW_BIT_FORMATS,
    Int8Weight,
    packed_weight,
    q6_k_from_raw,
    quantize_q4_k,
)

SHAPES = {
    "default": {"gate_up 3072x576": (3072, 576), "head 49152x576": (49152, 576)},
    "1b": {
        "qkv 3072x2048": (3072, 2048),
        "gate_up 16384x2048": (16384, 2048),
        "down 2048x8192": (2048, 8192),
    },
    "8b": {
        "qkv 6144x4096": (6144, 4096),
        "gate_up 28672x4096": (28672, 4096),
        "down 4096x14336": (4096, 14336),
    },
    # The 1B shape's LM head (tied embeddings; Q6_K in a Q4_K_M file): 148-263 MB by format,
    # several times the L3 of the hosts measured, so a decode-sized call reads it from memory.
    "1b-head": {"head 128256x2048": (128256, 2048)},
}
FORMATS = ("q8_0", "q5_0", "q4_0", "q4_k", "q6_k", "q6_k16")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def weight(n: int, k: int, fmt: str) -> Int8Weight:
    gen = torch.Generator().manual_seed(0)
    if fmt == "q4_k":
        return quantize_q4_k(torch.randn(n, k, generator=gen))
    if fmt in ("q6_k", "q6_k16"):
        raw = torch.randint(0, 256, (n, k // 256, 210), generator=gen, dtype=torch.uint8)
        raw[..., 208:] = torch.full((n, k // 256, 1), 1e-4).half().view(torch.uint8)
        q = q6_k_from_raw(raw.view(n, -1))
        return q if fmt == "q6_k" else Int8Weight(q.codes, q.scales, "q6_k")
    scales = torch.rand(n, k // 32, generator=gen) * 1e-3
    if fmt == "q8_0":
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return Int8Weight(codes, scales, fmt)
    zero = 1 << (LOW_BIT_FORMATS[fmt] - 1)
    return Int8Weight(
        torch.randint(-zero, zero, (n, k), generator=gen, dtype=torch.int8), scales, fmt
    )


def time_call(n: int, k: int, fmt: str, rows: int, threads: int, repeats: int) -> tuple[float, int]:
    codes, scales = packed_weight(weight(n, k, fmt))
    x = torch.randn(rows, k).bfloat16()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    kernel = linear_int8_kernel()
    for _ in range(3):
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
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    ap.add_argument("--rows", default="1", help="comma-separated row counts of x")
    ap.add_argument("--formats", default="q8_0,q5_0,q4_0,q4_k", help=f"some of {FORMATS}")
    args = ap.parse_args()
    if linear_int8_kernel() is None:
        raise SystemExit("the kernels are not built on this host")
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown formats {sorted(unknown)}; the formats: {FORMATS}")
    cpuinfo = Path("/proc/cpuinfo").read_text()
    print(f"# flags: {' '.join(f for f in FLAGS if f in cpuinfo)}; threads {args.threads}")
    for rows in (int(r) for r in args.rows.split(",")):
        # Many rows: weight GB/s means little; rows x weights per second (GMAC/s) is the rate.
        unit = "GB/s" if rows == 1 else "GMAC/s"
        print(f"\n{rows} row(s) of x")
        print("| shape | " + " | ".join(f"{f} us ({unit})" for f in formats) + " |")
        print("|---|" + "---:|" * len(formats))
        for name, (n, k) in SHAPES[args.shapes].items():
            cells = []
            for fmt in formats:
                if fmt in ("q4_k", "q6_k", "q6_k16") and k % 256:
                    cells.append("-")
                    continue
                repeats = args.repeats if rows == 1 else max(3, args.repeats // 20)
                seconds, nbytes = time_call(n, k, fmt, rows, args.threads, repeats)
                rate = nbytes / seconds / 1e9 if rows == 1 else rows * n * k / seconds / 1e9
                cells.append(f"{seconds * 1e6:.1f} ({rate:.1f})")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
