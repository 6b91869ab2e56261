"""The flags of `prefixserve bench compare` (which hands them here) and of
`python -m benchmarks.serving`:

    prefixserve bench compare --engines prefixserve,vllm,llama.cpp --workloads W0,W1,W2,W3
    prefixserve bench compare --engines prefixserve,prefixserve+ngram,vllm,vllm+ngram \
        --workloads W7 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    prefixserve bench compare --engines prefixserve-ram,vllm-hermes,llama-server --workloads W9
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.serving.servers import (
    DEFAULT_NGRAM_CONFIG,
    ENGINES,
    SPEC_SUFFIX,
    VLLM_DTYPES,
    peers_dir,
)
from prefixserve.bench.cli import add_load_args, csv_list, default_model_dir

if TYPE_CHECKING:
    from benchmarks.serving.compare import CompareConfig


def _default_gguf(model_dir: Path) -> Path:
    return peers_dir() / "gguf" / f"{model_dir.name}-bf16.gguf"


def build_parser(prog: str = "python -m benchmarks.serving") -> argparse.ArgumentParser:
    cmp_ = argparse.ArgumentParser(
        prog=prog, description="Run engines one after another on the same workloads."
    )
    cmp_.add_argument(
        "--engines",
        type=csv_list,
        default=["prefixserve", "vllm", "llama.cpp"],
        help=f"comma-separated, from: {', '.join(ENGINES)}",
    )
    add_load_args(cmp_)
    cmp_.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="GGUF for llama.cpp (default: what setup_llama_cpp.sh made)",
    )
    cmp_.add_argument("--threads", type=int, default=2, help="threads per server (OMP_NUM_THREADS)")
    cmp_.add_argument("--port", type=int, default=8765)
    cmp_.add_argument("--max-model-len", type=int, default=4096)
    cmp_.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="KV-cache memory given to each engine (GiB)"
    )
    cmp_.add_argument(
        "--kv-pool-tokens",
        type=int,
        default=None,
        help="a KV pool of this many tokens (a multiple of 32) instead of --kv-cache-gib, the "
        "same for prefixserve and vLLM (blocks = tokens / its block size; vLLM: "
        "--num-gpu-blocks-override; llama.cpp has no such pool): W4 about 6,400, W5 about 17,600",
    )
    cmp_.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step for prefixserve and vLLM (vLLM's CPU default)",
    )
    cmp_.add_argument(
        "--max-num-seqs",
        type=int,
        default=128,
        help="requests per step for prefixserve and vLLM (vLLM's CPU default)",
    )
    cmp_.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help=f"speculative decoding of the {SPEC_SUFFIX} engines, vLLM's JSON, passed to each "
        f"as --speculative-config (method ngram; default {DEFAULT_NGRAM_CONFIG})",
    )
    cmp_.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="serve N random LoRA adapters (rank --lora-rank, all seven projections) on "
        "prefixserve and vLLM alike; each prompt group (a W1 system prompt, a W3 document) "
        "names one of them in `model`, in turn (0: the base model only)",
    )
    cmp_.add_argument("--lora-rank", type=int, default=16)
    cmp_.add_argument(
        "--vllm-dtype",
        choices=VLLM_DTYPES,
        default="bfloat16",
        help="vLLM's --dtype (without AVX512-BF16 its bf16 linears fall back to torch's)",
    )
    cmp_.add_argument("--warmup", type=int, default=4, help="warm-up requests per engine")
    cmp_.add_argument(
        "--figures-dir", type=Path, default=None, help="also copy the PNGs here (e.g. docs/bench)"
    )
    cmp_.add_argument("--no-progress", action="store_true")
    return cmp_


def _copy_figures(out: Path, workloads: list[str], figures_dir: Path | None) -> None:
    if figures_dir is None:
        return
    figures_dir.mkdir(parents=True, exist_ok=True)
    for name in workloads:
        for suffix in ("", "-spec"):
            png = out / f"{name}{suffix}.png"
            if png.exists():
                shutil.copy(png, figures_dir / f"serving_{name}{suffix.replace('-', '_')}.png")


def _config(args: argparse.Namespace, model_dir: Path, gguf: Path | None) -> CompareConfig:
    """The CompareConfig of the parsed flags; ValueError names a bad one."""
    from benchmarks.serving.compare import CompareConfig

    return CompareConfig(
        engines=args.engines,
        workloads=args.workloads,
        model_dir=model_dir,
        out_dir=args.out,
        gguf_path=gguf,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        scale=args.scale,
        num_warmup=args.warmup,
        threads=args.threads,
        port=args.port,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_pool_tokens=args.kv_pool_tokens,
        speculative_config=args.speculative_config,
        lora_adapters=args.lora_adapters,
        lora_rank=args.lora_rank,
        sessions=args.sessions,
        turns=args.turns,
        strict_tools=args.strict_tools,
        vllm_dtype=args.vllm_dtype,
    )


def run(args: argparse.Namespace) -> int:
    """Run the comparison the parsed flags describe; print the tables; 1 if an engine failed."""
    from benchmarks.serving.compare import report, run_compare

    model_dir = args.model or default_model_dir()
    gguf = args.gguf
    if gguf is None and ({"llama.cpp", "llama-server"} & set(args.engines)):
        gguf = _default_gguf(model_dir)
    try:
        cfg = _config(args, model_dir, gguf)
    except ValueError as exc:
        print(f"bench compare: {exc}", file=sys.stderr)
        return 2
    status = run_compare(cfg, progress=not args.no_progress)
    print(report(args.out, cfg.workloads))
    _copy_figures(args.out, cfg.workloads, args.figures_dir)
    failed = {k: v for k, v in status.items() if v != "ok"}
    for engine, why in failed.items():
        print(f"{engine}: FAILED: {why.splitlines()[0]}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.serving") -> int:
    """Parse `argv` (default: sys.argv[1:]) as `prog`'s flags and run the comparison."""
    return run(build_parser(prog).parse_args(argv))
