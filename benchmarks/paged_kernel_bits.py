"""The paged kernel's outputs over 216 shapes, saved, or compared with a saved set bit for bit:
how a kernel change that should not change any query's bits is checked against an older build.

    .venv/bin/python benchmarks/paged_kernel_bits.py save /tmp/old.pt      # in the old checkout
    .venv/bin/python benchmarks/paged_kernel_bits.py compare /tmp/old.pt   # in the new one

Shapes: KV dtypes bf16, int8, fp8_e4m3; head dims 64, 128, 256; GQA 9/3, 4/1, 8/8; a decode row
at 700, 16 decode rows at 300, two 37-row chunks at 200, a 70-row chunk at 130; no window and a
100-token window; blocks shuffled. The kernel as the engine calls it (`PREFIXSERVE_KERNEL_MARCH`
picks the build). Run an old checkout with its own `PREFIXSERVE_CACHE_DIR`.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from prefixserve.model.kernels.build import paged_attention_kernel
from prefixserve.model.quant.kv_cache import kv_format, quantize_rows

BLOCK = 16
DTYPES = ("int8", "fp8_e4m3", "bf16")
HEAD_DIMS = (64, 128, 256)
GQA = ((9, 3), (4, 1), (8, 8))
CALLS = ((1, 700, 1), (16, 300, 1), (2, 200, 37), (1, 130, 70))  # (sequences, context, rows)
WINDOWS = (0, 100)


def one_case(kernel, dtype, head_dim, heads, kv_heads, seqs, ctx, rows, window) -> torch.Tensor:
    """The kernel's output for one shape, its inputs drawn from a seed the shape fixes."""
    per = -(-(ctx + rows) // BLOCK)
    blocks = seqs * per + 1  # block 0 unused (the engine's null block)
    g = torch.Generator().manual_seed(head_dim * 7 + heads + seqs + window)
    k = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=g).bfloat16()
    if dtype != "bf16":
        fmt = kv_format(dtype, torch.bfloat16)
        k, v = quantize_rows(k, fmt), quantize_rows(v, fmt)
    tables = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32).view(seqs, per)
    info = torch.tensor([(i * rows, (i + 1) * rows, ctx) for i in range(seqs)], dtype=torch.int64)
    q = torch.randn(seqs * rows, heads, head_dim, generator=g).bfloat16()
    out = torch.empty(seqs * rows, heads * head_dim, dtype=torch.bfloat16)
    kernel(out, q, k, v, tables, info, head_dim**-0.5, 0.0, window)
    return out


def outputs() -> dict[tuple, torch.Tensor]:
    kernel = paged_attention_kernel()
    if kernel is None:
        raise SystemExit("the native kernels are not built here")
    result = {}
    for dtype, head_dim, (heads, kv_heads), call, window in itertools.product(
        DTYPES, HEAD_DIMS, GQA, CALLS, WINDOWS
    ):
        key = (dtype, head_dim, heads, kv_heads, *call, window)
        result[key] = one_case(kernel, dtype, head_dim, heads, kv_heads, *call, window)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["save", "compare"])
    ap.add_argument("path")
    args = ap.parse_args()
    mine = outputs()
    if args.mode == "save":
        torch.save(mine, args.path)
        print(f"{len(mine)} outputs saved to {args.path}")
        return
    saved = torch.load(args.path)
    differ = [
        k for k in saved if not torch.equal(saved[k].view(torch.int16), mine[k].view(torch.int16))
    ]
    print(f"{len(saved)} shapes, {len(differ)} with other bits")
    for key in differ[:10]:
        print("  ", key)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
