"""Memory read bandwidth of this host, and the decode speed it allows the model at batch 1.

    .venv/bin/python benchmarks/bench_bandwidth.py [--gib 1] [--context 128] [--model DIR|.gguf]

Decode at batch 1 reads every weight of every linear once per token (the LM head included) and
the K/V of the context; nothing else is big. With the read bandwidth B measured here (torch
threads as the engine runs them), `bytes per token / B` is the least time a token can take, and
its inverse the bandwidth limit of decode in tok/s (issue 13's reference: decode within 1.5x of
it). Bandwidth is measured two ways, each the median of 7 repeats over a buffer far larger than
the last-level cache: a sum over fp32 (reads only) and a copy (read + write, both counted).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_bandwidth(gib: float) -> dict[str, float]:
    """GB/s of a read-only sum and of a copy (bytes read + written) over `gib` GiB."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    return {
        "sum (read)": nbytes / median_seconds(src.sum) / 1e9,
        "copy (read + write)": 2 * nbytes / median_seconds(lambda: dst.copy_(src)) / 1e9,
    }


def decode_bytes_per_token(model: nn.Module, config, context: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode token reads at batch 1: every linear weight once
    (a tied LM head counted once, as the head; an 8-bit one as its codes and scales) and the
    K/V of `context` positions."""
    seen: set[int] = set()
    weights = 0
    for module in model.modules():
        int8 = getattr(module, "_int8", None)
        if int8 is not None:
            weights += int8[0].numel() + int8[1].numel() * int8[1].element_size()
        elif isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            weights += module.weight.numel() * module.weight.element_size()
    itemsize = torch.empty(0, dtype=config.torch_dtype).element_size()
    kv = 2 * config.num_layers * context * config.num_kv_heads * config.head_dim * itemsize
    return weights, kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size (GiB)")
    ap.add_argument("--context", type=int, default=128, help="decode context (tokens)")
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the default model)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{describe_cpu()} | threads {torch.get_num_threads()} | load avg {os.getloadavg()[0]:.1f}"
    )
    with torch.inference_mode():
        bandwidth = read_bandwidth(args.gib)
    for name, gbs in bandwidth.items():
        print(f"bandwidth, {name}: {gbs:.1f} GB/s")
    best = max(bandwidth.values())

    from prefixserve.model.loader.loading import load_model

    loaded = load_model(args.model, dtype="bfloat16")
    weights, kv = decode_bytes_per_token(loaded.model, loaded.config, args.context)
    total = weights + kv
    print(
        f"model {loaded.path}: decode batch 1 reads {weights / 1e6:.1f} MB of weights + "
        f"{kv / 1e6:.1f} MB of K/V (context {args.context}) = {total / 1e6:.1f} MB per token"
    )
    print(
        f"bandwidth limit at {best:.1f} GB/s: {total / best / 1e6:.2f} ms per token, "
        f"{best * 1e9 / total:.1f} tok/s (1.5x of it: {best * 1e9 / total / 1.5:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
