"""Decode attention over a whole model's K/V from memory, per KV cache dtype.

    .venv/bin/python benchmarks/bench_kv_attention.py --kv-cache-dtypes bf16,int8,fp8_e4m3

One decode step's attention calls of SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim
64, block size 16; `--shape gemma3`: Gemma 3 270M's, 4 query heads, 1 KV head, head dim 256):
`--layers` layers, each with its own K/V caches (so a step reads them from memory, as a
model's step does, not from the last level cache), `--batch` sequences at `--context`, each with
`--rows` query rows (1: decode; more: a speculative step verifying drafts), their blocks
shuffled over the cache (`--contiguous`: each sequence's blocks in order). The paged kernel as
the engine calls it (`--portable`: its portable path, what CPUs without AVX2 run; a dtype with
`-avx2` appended, e.g. `int8-avx2`: that cache on the 256-bit keys-in-lanes tiles, what AVX2
hosts run, beside the build's widest). Milliseconds per step, median (min-max) over
`--repeats`, the dtypes measured in turn within each repeat.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from prefixserve.model.kernels.build import (  # noqa: E402
    paged_attention_avx2_kernel,
    paged_attention_kernel,
    paged_attention_portable_kernel,
)
from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402
from prefixserve.model.kernels.hugepages import huge_page_arena  # noqa: E402
from prefixserve.model.quant.kv_cache import kv_format, quantize_rows  # noqa: E402

BLOCK = 16
SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head dim


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in transparent huge pages (`t` itself where they cannot be had)."""
    arena = huge_page_arena(t.numel() * t.element_size())
    if arena is None:
        return t
    view = arena[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def caches(
    dtype: str, layers: int, blocks: int, seed: int, kv_heads: int, head_dim: int, huge: bool
) -> list[tuple[torch.Tensor, ...]]:
    """`layers` (K, V) cache pairs of random rows, in `dtype` ("bf16" or an 8-bit KV dtype),
    in huge pages if `huge`."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, kv_heads, head_dim)
    out = []
    for _ in range(layers):
        pair = (
            torch.randn(shape, generator=g).bfloat16(),
            torch.randn(shape, generator=g).bfloat16(),
        )
        if dtype.removesuffix("-avx2") != "bf16":
            fmt = kv_format(dtype.removesuffix("-avx2"), torch.bfloat16)
            pair = tuple(quantize_rows(c, fmt) for c in pair)
        if huge:
            pair = tuple(in_huge_pages(c) for c in pair)
        out.append(pair)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-cache-dtypes", default="bf16,int8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--rows", type=int, default=1, help="query rows a sequence (drafts + 1)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps timed per repeat")
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--portable", action="store_true")
    ap.add_argument("--huge-pages", action="store_true", help="caches in transparent huge pages")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = ap.parse_args()
    heads, kv_heads, head_dim = SHAPES[args.shape]
    kernel = paged_attention_portable_kernel() if args.portable else paged_attention_kernel()
    if kernel is None:
        raise SystemExit("the native kernels are not built here")
    if args.rows < 1:
        raise SystemExit("--rows must be at least 1")
    rows = args.rows
    per_seq = -(-(args.context + rows) // BLOCK)
    blocks = args.batch * per_seq + 1  # block 0 stays unused, as the engine's null block
    order = torch.arange(1, blocks)
    if not args.contiguous:
        order = order[torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(1))]
    tables = order.to(torch.int32).view(args.batch, per_seq)
    info = torch.tensor(
        [(i * rows, (i + 1) * rows, args.context) for i in range(args.batch)], dtype=torch.int64
    )
    q = torch.randn(args.batch * rows, heads, head_dim, generator=torch.Generator().manual_seed(2))
    q = q.bfloat16()
    out = torch.empty(args.batch * rows, heads * head_dim, dtype=torch.bfloat16)
    dtypes = args.kv_cache_dtypes.split(",")
    kv = {
        d: caches(d, args.layers, blocks, i, kv_heads, head_dim, args.huge_pages)
        for i, d in enumerate(dtypes)
    }

    avx2_tiles = paged_attention_avx2_kernel()

    def step(dtype: str) -> None:
        for k_cache, v_cache in kv[dtype]:
            if dtype.endswith("-avx2"):
                if not avx2_tiles(out, q, k_cache, v_cache, tables, info, head_dim**-0.5, 0.0, 0):
                    raise SystemExit(f"the 256-bit tiles do not serve {dtype} here")
            else:
                kernel(out, q, k_cache, v_cache, tables, info, head_dim**-0.5, 0.0, 0)

    samples: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(args.repeats):
        for d in dtypes:
            step(d)  # warm: the code, not the caches (30 layers' K/V outgrow the L3)
            start = time.perf_counter()
            for _ in range(args.steps):
                step(d)
            samples[d].append((time.perf_counter() - start) / args.steps * 1e3)
    path = "portable" if args.portable else "default"
    print(
        f"{describe_cpu()} | threads {torch.get_num_threads()} | load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{args.shape} shape, batch {args.batch}, {rows} rows each, context {args.context}, "
        f"{args.layers} layers, "
        f"{'contiguous' if args.contiguous else 'shuffled'} blocks, {path} path, "
        f"{'huge' if args.huge_pages else 'ordinary'} pages"
    )
    print("| KV cache | K/V read a step (MB) | ms a step, median (min-max) | vs first |")
    print("|---|---:|---:|---:|")
    first = statistics.median(samples[dtypes[0]])
    for d in dtypes:
        k_cache, _ = kv[d][0]
        row = k_cache[0, 0, 0].numel() * k_cache.element_size()
        read = 2 * args.batch * (args.context + rows) * kv_heads * row * args.layers / 1e6
        ms = statistics.median(samples[d])
        spread = f"{min(samples[d]):.1f}-{max(samples[d]):.1f}"
        print(f"| {d} | {read:.0f} | {ms:.2f} ({spread}) | {first / ms:.2f}x |")


if __name__ == "__main__":
    main()
