"""`prefixserve bench ...`: argparse setup, registered into prefixserve/cli.py by `register`.

    prefixserve bench compare --engines prefixserve,vllm,llama.cpp --workloads W0,W1,W2,W3
    prefixserve bench run --base-url http://127.0.0.1:8000 --workload W1
    prefixserve bench report --out bench-results

Also runnable as ``python -m prefixserve.bench ...`` with the same arguments after ``bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from prefixserve.bench.servers import ENGINES, peers_dir
from prefixserve.bench.workloads import WORKLOAD_NAMES


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _default_model_dir() -> Path:
    from prefixserve.model.default_model import ensure_default_model

    return Path(ensure_default_model())


def _default_gguf(model_dir: Path) -> Path:
    return peers_dir() / "gguf" / f"{model_dir.name}-bf16.gguf"


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        type=_csv,
        default=list(WORKLOAD_NAMES),
        help="comma-separated subset of W0,W1,W2,W3 (default: all)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests in flight (closed loop), or the cap with --request-rate",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s instead of a closed loop",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the number of requests of every workload (not their lengths)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF model dir (default: the packaged default model, bf16)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="results directory")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command (with compare / run / report) to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="serving benchmarks: ours beside vLLM, llama.cpp")
    bench.set_defaults(_run=configure(bench))
    return bench


def configure(bench: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add compare / run / report to the `bench` parser; return the function that runs them
    (what prefixserve/cli.py's `@subcommand` hook expects)."""
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    cmp_ = sub.add_parser("compare", help="run engines one after another on the same workloads")
    cmp_.add_argument(
        "--engines",
        type=_csv,
        default=["prefixserve", "vllm", "llama.cpp"],
        help=f"comma-separated, from: {', '.join(ENGINES)}",
    )
    _add_load_args(cmp_)
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
    cmp_.add_argument("--warmup", type=int, default=4, help="warm-up requests per engine")
    cmp_.add_argument(
        "--figures-dir", type=Path, default=None, help="also copy the PNGs here (e.g. docs/bench)"
    )
    cmp_.add_argument("--no-progress", action="store_true")
    cmp_.set_defaults(func=_cmd_compare)

    run = sub.add_parser("run", help="drive one running OpenAI-compatible server")
    run.add_argument("--base-url", required=True)
    run.add_argument("--served-model", default=None, help="model name (default: /v1/models)")
    run.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens")
    run.add_argument("--name", default="server", help="engine name in the results")
    _add_load_args(run)
    run.set_defaults(func=_cmd_run)

    rep = sub.add_parser("report", help="rebuild tables and figures from a results directory")
    rep.add_argument("--out", type=Path, default=Path("bench-results"))
    rep.add_argument("--workloads", type=_csv, default=list(WORKLOAD_NAMES))
    rep.set_defaults(func=_cmd_report)
    return _dispatch


def _dispatch(args: argparse.Namespace) -> int:
    return int(args.func(args))


def _copy_figures(out: Path, workloads: list[str], figures_dir: Path | None) -> None:
    if figures_dir is None:
        return
    figures_dir.mkdir(parents=True, exist_ok=True)
    for name in workloads:
        png = out / f"{name}.png"
        if png.exists():
            shutil.copy(png, figures_dir / f"serving_{name}.png")


def _cmd_compare(args: argparse.Namespace) -> int:
    from prefixserve.bench.compare import CompareConfig, report, run_compare

    model_dir = args.model or _default_model_dir()
    gguf = args.gguf
    if gguf is None and "llama.cpp" in args.engines:
        gguf = _default_gguf(model_dir)
    cfg = CompareConfig(
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
    )
    status = run_compare(cfg, progress=not args.no_progress)
    print(report(args.out, cfg.workloads))
    _copy_figures(args.out, cfg.workloads, args.figures_dir)
    failed = {k: v for k, v in status.items() if v != "ok"}
    for engine, why in failed.items():
        print(f"{engine}: FAILED: {why.splitlines()[0]}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_run(args: argparse.Namespace) -> int:
    import httpx
    from tqdm import tqdm

    from prefixserve.bench.client import EndpointConfig, run_workload
    from prefixserve.bench.compare import load_token_pool, report
    from prefixserve.bench.summary import summarize
    from prefixserve.bench.workloads import make_workload, prepend_tokens

    model_dir = args.model or _default_model_dir()
    pool, decode, special_prefix = load_token_pool(model_dir)
    served = args.served_model
    if served is None:
        served = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0][
            "id"
        ]
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=served,
        prompt_format=args.prompt_format,
        extra_body={"ignore_eos": True},
    )
    for name in args.workloads:
        workload = make_workload(name, pool, seed=args.seed, scale=args.scale, decode=decode)
        prepend_tokens(workload.requests, special_prefix)
        with tqdm(total=len(workload.requests), desc=f"{args.name}: {workload.name}") as bar:
            result = asyncio.run(
                run_workload(
                    workload.requests,
                    endpoint,
                    concurrency=args.concurrency,
                    request_rate=args.request_rate,
                    seed=args.seed,
                    on_done=lambda _: bar.update(1),
                )
            )
        summary = summarize(result.records, result.duration)
        path = args.out / workload.name / f"{args.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "engine": args.name,
                    "workload": workload.name,
                    "description": workload.description,
                    "seed": args.seed,
                    "scale": args.scale,
                    "base_url": args.base_url,
                    "summary": summary.to_dict(),
                    "run": result.to_dict(),
                },
                indent=1,
            )
        )
    print(report(args.out, [w.upper() for w in args.workloads]))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from prefixserve.bench.compare import report

    print(report(args.out, [w.upper() for w in args.workloads]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m prefixserve.bench ...`: the `bench` command on its own."""
    parser = argparse.ArgumentParser(prog="python -m prefixserve.bench")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args._run(args))
