"""Paged attention: the compiled kernels against the PyTorch path (gather + SDPA), one layer.

    .venv/bin/python benchmarks/bench_attention.py

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, bf16, block size 16), K/V
scattered over shuffled cache blocks. Three families of cases: decode steps (batch x context, one
new token each), decode steps whose sequences share a cached prefix (the same blocks; the kernel
reads them once per step for up to 4 sequences), one chunk of n new tokens over a 1,024-token
cached prefix, and prompts of n tokens with nothing cached (where `KERNEL_MAX_QUERIES` comes
from). Milliseconds per call, median of 7 repeats. Columns: the paged kernel (every sequence; in
bf16 on an AVX512-BF16 build its keys-in-lanes path), its portable path (fp32 tiles, tree-summed
scores: what other CPUs and dtypes run; only where the two differ), the long-chunk prefill
kernel (chunks of 32+ tokens, gathered K/V as the SDPA path has them; "-" where it does not
apply or is not built here), and PyTorch's path.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

import prefixserve.model.layers.attention as attention  # noqa: E402
from prefixserve.model.kernels.build import (  # noqa: E402
    attention_kernels_agree,
    paged_attention_kernel,
    paged_attention_portable_kernel,
    prefill_attention_kernel,
)
from prefixserve.model.layers.attention import (  # noqa: E402
    ScheduledSpan,
    build_attention_metadata,
    paged_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def case(seqs: list[tuple[int, int]], shared_tokens: int = 0):
    """seqs: (cached tokens, new tokens) per sequence -> q, caches, spans. The first
    `shared_tokens` (whole blocks) of every sequence are the same cached blocks (a prefix hit)."""
    g = torch.Generator().manual_seed(0)
    blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 1
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).bfloat16()
    v_cache = torch.randn(shape, generator=g).bfloat16()
    free = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    shared = [free.pop() for _ in range(shared_tokens // BLOCK)]
    spans = []
    for cached, new in seqs:
        own = -(-(cached + new) // BLOCK) - len(shared)
        table = shared + [free.pop() for _ in range(own)]
        spans.append(ScheduledSpan(cached, new, (table,)))
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).bfloat16()
    return q, k_cache, v_cache, spans


def ms_per_call(fn) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(5):
            fn()
        samples.append((time.perf_counter() - start) / 5 * 1e3)
    return statistics.median(samples)


def main() -> None:
    kernel = paged_attention_kernel()
    if kernel is None:
        raise SystemExit("the kernel is not available here (see the warning)")
    print(
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | load avg "
        f"{os.getloadavg()[0]:.1f}"
    )
    prefill = prefill_attention_kernel()
    paths: list[tuple[str, Callable[..., None] | None, Callable[..., None] | None]] = [
        ("paged", kernel, None)
    ]
    if attention_kernels_agree():  # the paged kernel's bf16 path has keys in lanes here
        paths.append(("portable", paged_attention_portable_kernel(), None))
    paths += [("prefill", None, prefill), ("PyTorch", None, None)]
    print(f"| case | {' | '.join(p[0] + ' ms' for p in paths)} | best |")
    print(f"|---|{'---:|' * len(paths)}---|")
    cases = [
        (f"decode, batch {b} x context {c}", [(c, 1)] * b, 0)
        for b, c in ((1, 1500), (8, 128), (8, 1500), (32, 512))
    ]
    cases += [
        ("decode, batch 8 x context 1,100, all sharing a 1,024 prefix", [(1100, 1)] * 8, 1024),
        ("decode, batch 8 x context 1,550, all sharing a 1,504 prefix", [(1550, 1)] * 8, 1504),
    ]
    cases += [
        (f"chunk of {n} over a 1,024 prefix", [(1024, n)], 0)
        for n in (4, 8, 16, 32, 64, 128, 256, 512)
    ]
    cases += [
        (f"prompt of {n} (no prefix)", [(0, n)], 0) for n in (32, 64, 128, 256, 512, 1024, 2048)
    ]
    with torch.inference_mode():
        for name, seqs, shared in cases:
            q, kc, vc, spans = case(seqs, shared)
            times: list[float | None] = []
            long_chunk = len(seqs) == 1 and seqs[0][1] >= 32
            for name_, fn, pre in paths:
                if name_ == "prefill" and (prefill is None or not long_chunk):
                    times.append(None)
                    continue
                # Route every sequence to the path under test, whatever KERNEL_MAX_QUERIES says.
                saved = attention.KERNEL_MAX_QUERIES
                attention.KERNEL_MAX_QUERIES = 1 << 30
                try:
                    meta = build_attention_metadata(spans, 0, BLOCK, None, fn, pre)
                finally:
                    attention.KERNEL_MAX_QUERIES = saved
                # The chunk's own K/V as the model passes them (read from where they were written).
                slots = meta.slot_mapping
                kn = kc.view(-1, KV_HEADS, HEAD_DIM)[slots]
                vn = vc.view(-1, KV_HEADS, HEAD_DIM)[slots]
                times.append(
                    ms_per_call(
                        lambda m=meta, q=q, kc=kc, vc=vc, kn=kn, vn=vn: paged_attention(
                            q, kc, vc, m, 0.125, None, kn, vn
                        )
                    )
                )
            cells = ["-" if t is None else f"{t:.2f}" for t in times]
            names = [p[0] for p in paths]
            best = min((t, n) for t, n in zip(times, names, strict=True) if t is not None)[1]
            print(f"| {name} | {' | '.join(cells)} | {best} |")


if __name__ == "__main__":
    main()
