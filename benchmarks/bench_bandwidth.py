"""Memory read bandwidth of this host, and the decode speed it allows the model at batch 1.

    .venv/bin/python benchmarks/bench_bandwidth.py [--gib 1] [--context 128] [--model DIR|.gguf]

Decode at batch 1 reads every weight of every linear once per token (the LM head included), one
row of the embedding, the norms and the K/V of the context (`weight_bytes_per_token`,
`kv_bytes_per_token`; a GGUF file as llama.cpp reads it: `gguf_weight_bytes_per_token`). With
the read bandwidth B measured here (torch threads as the engine runs them), `bytes per token / B`
is the least time a token can take, and its inverse the bandwidth limit of decode in tok/s
(issue 13's reference: decode within 1.5x of it). Bandwidth is measured three ways, each the
median of 7 repeats over a buffer far larger than the last-level cache: a sum over fp32 (reads
only), a copy (read + write, both counted) and one row through a bf16 linear on the native
kernels (a stream of its packed weight, as decode reads; on a 2-core Xeon VM it read 1.5-3x what
torch's sum did). The best of them is the reference (bench_model.py's accounting takes it too).
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
    """GB/s of a read-only sum and of a copy (bytes read + written) over `gib` GiB, and of one
    row through a bf16 linear of `gib` GiB on the native kernels (a pure stream of its packed
    weight: what decode at batch 1 does; absent without the kernels)."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    out = {
        "sum (read)": nbytes / median_seconds(src.sum) / 1e9,
        "copy (read + write)": 2 * nbytes / median_seconds(lambda: dst.copy_(src)) / 1e9,
    }
    stream = _linear_stream(nbytes)
    if stream is not None:
        out["bf16 linear, one row (read)"] = stream
    return out


def _linear_stream(nbytes: int) -> float | None:
    """GB/s of one row through a bf16 Linear of `nbytes` of weight packed for the native GEMM."""
    from prefixserve.model.layers.kernel_table import _kernel
    from prefixserve.model.layers.linear import Linear

    if _kernel("gemm") is None:
        return None
    k = 4096
    linear = Linear(k, nbytes // (2 * k), bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    linear.pack(fp32_copy=False)
    linear.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    packed = linear._gemm[0]
    x = torch.ones(1, k, dtype=torch.bfloat16)
    with torch.inference_mode():
        seconds = median_seconds(lambda: linear(x))
    return packed.numel() * packed.element_size() / seconds / 1e9


def linear_bytes(module: nn.Linear) -> int:
    """The bytes a decode step reads of one linear: what its kernel streams (8-bit or 4-bit
    codes and their scales and mins; the native GEMM's packed bf16 weight; else the weight as it
    is) and the bias."""
    int8 = getattr(module, "_int8", None)
    if int8 is not None:
        return sum(t.numel() * t.element_size() for t in int8 if t is not None)
    gemm = getattr(module, "_gemm", None)
    weight = gemm[0] if gemm is not None else module.weight
    bias = 0 if module.bias is None else module.bias.numel() * module.bias.element_size()
    return weight.numel() * weight.element_size() + bias


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode token reads at batch 1, as our kernels keep them: every
    linear once (`linear_bytes`; a tied LM head as the head), one row of each embedding, and
    every other parameter (norms)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if id(module) not in seen:
                seen.add(id(module))
                seen.update(id(p) for p in module.parameters(recurse=False))
                total += linear_bytes(module)
        elif isinstance(module, nn.Embedding):
            seen.add(id(module.weight))
            total += module.weight[0].numel() * module.weight.element_size()
    for param in model.parameters():
        if id(param) not in seen and param.numel():
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def gguf_weight_bytes_per_token(path: str | os.PathLike[str]) -> int:
    """Bytes of a GGUF file's tensors one decode token reads at batch 1 in llama.cpp: every
    tensor as the file stores it, but of the token embedding one row (and the whole of it again
    as the LM head when the file has no `output.weight`)."""
    from prefixserve.model.loader.gguf_reader import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    total = sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight")
    embed = tensors.get("token_embd.weight")
    if embed is not None:
        rows = int(embed.shape[-1])  # GGUF's shape is ne: [hidden, vocab]
        total += int(embed.n_bytes) // rows
        if "output.weight" not in tensors:
            total += int(embed.n_bytes)
    return total


def kv_bytes_per_token(config, context: int, itemsize: int | None = None) -> int:
    """Bytes of K/V one decode token reads at batch 1 over `context` positions."""
    if itemsize is None:
        itemsize = torch.empty(0, dtype=config.torch_dtype).element_size()
    return 2 * config.num_layers * context * config.num_kv_heads * config.head_dim * itemsize


def decode_bytes_per_token(model: nn.Module, config, context: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode token reads at batch 1: `weight_bytes_per_token`
    and the K/V of `context` positions."""
    return weight_bytes_per_token(model), kv_bytes_per_token(config, context)


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
