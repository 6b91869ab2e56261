"""The `prefixserve` command: `prefixserve serve [MODEL] ...`, `prefixserve bench ...`.

Each subcommand is one function decorated with `@subcommand(name, help)`: it receives its own
argparse parser, adds its flags, and returns the function that runs it (taking the parsed
arguments and returning an exit code). Adding a subcommand is adding one such function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from prefixserve.config import SCHEDULING_POLICIES, CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.dtypes import SUPPORTED_DTYPES
from prefixserve.kv_cache.hashing import HASH_ALGOS
from prefixserve.kv_store.options import add_kv_store_arguments, kv_store_config_from_args
from prefixserve.server.options import (
    add_server_limit_arguments,
    admission_from_args,
    app_limits,
    check_limit_arguments,
    uvicorn_limits,
)
from prefixserve.stats_log import describe_engine

logger = logging.getLogger("prefixserve")

Runner = Callable[[argparse.Namespace], int]
Subcommand = Callable[[argparse.ArgumentParser], Runner]

_SUBCOMMANDS: dict[str, tuple[str, Subcommand]] = {}


def subcommand(name: str, help: str) -> Callable[[Subcommand], Subcommand]:  # noqa: A002
    """Register `fn(parser) -> runner` as `prefixserve <name>`."""

    def register(fn: Subcommand) -> Subcommand:
        _SUBCOMMANDS[name] = (help, fn)
        return fn

    return register


class _HelpFormatter(argparse.HelpFormatter):
    """Appends a flag's default to its help unless the help already tells it (or it is unset)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not any(action.default is unset for unset in (None, False, argparse.SUPPRESS))
            and action.option_strings
            and "Default" not in text
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve",
        description="An LLM serving engine built around automatic prefix caching.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, fn) in _SUBCOMMANDS.items():
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=_HelpFormatter,
        )
        sub.set_defaults(_run=fn(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


# ------------------------------------------------------------------------------------- serve
@subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API.")
def serve_command(parser: argparse.ArgumentParser) -> Runner:
    add_engine_arguments(parser)
    add_kv_store_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) clients use in the `model` field; the first is reported in "
        "responses. Default: MODEL's last path part, or the default model's name.",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer <key>` on every endpoint except /health. The "
        "key's requests form one tenant named 'default'.",
    )
    server.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="File of 'KEY TENANT' lines ('#' comments allowed): each key belongs to a tenant, "
        "and tenants never share prefix-cache blocks (the tenant becomes the cache-salt "
        "namespace; a client's cache_salt only subdivides its own tenant's). Combines with "
        "--api-key.",
    )
    add_server_limit_arguments(server)
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="Do not log the periodic throughput / queue / KV usage / hit rate line.",
    )
    server.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="Seconds between two periodic stats lines while the engine is busy.",
    )
    server.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="Abort a request (freeing its KV blocks) whose output nobody has read for this long "
        "(a stalled client); 0 turns it off.",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="Log level of the server and the engine.",
    )
    return run_serve


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (vLLM's names where vLLM has one); shared with other subcommands."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="A Hugging Face model directory or a .gguf file. Default: the packaged default "
        "model (SmolLM2-135M-Instruct), converted on first use.",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--dtype",
        default="bfloat16",
        choices=SUPPORTED_DTYPES,
        help="Weights and KV-cache dtype (float16 is not supported on the CPU).",
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Context length (prompt + output tokens). Default: the model's own.",
    )
    engine.add_argument("--seed", type=int, default=0, help="Seed of the sampler.")
    cache = parser.add_argument_group("KV cache and prefix caching")
    cache.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="Tokens per KV-cache block; the unit of prefix-cache reuse (only full blocks are "
        "shared).",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV blocks of prompt prefixes seen before (automatic prefix caching).",
    )
    cache.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=HASH_ALGOS,
        help="Hash chaining the block contents: sha256 (collision-resistant, the safe choice "
        "when tenants share a server) or xxhash (faster, not cryptographic).",
    )
    pool = cache.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="Size of the KV-cache pool in blocks (vLLM: --num-gpu-blocks-override). Default: "
        "sized from --kv-cache-memory-gb.",
    )
    pool.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="Memory for the KV-cache pool in GiB. Default: 1 GiB, or less when max-num-seqs "
        "requests at full context need less.",
    )
    cache.add_argument(
        "--kv-events",
        action="store_true",
        help="Record KV-cache events (blocks stored, evicted, cache cleared), served at "
        "GET /kv_events for KV-aware routers.",
    )
    parser.add_argument(
        "--max-pinned-blocks",
        type=int,
        default=None,
        help="Most KV blocks operators may pin with POST /pins (default: a quarter of the pool).",
    )
    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-seqs", type=int, default=256, help="Most requests running in one step."
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="Most tokens computed in one step (prefill chunks plus one per decoding request).",
    )
    sched.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="Cap on one request's prefill chunk per step, so long prompts do not stall the "
        "others (0: no cap).",
    )
    sched.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fair",
        help="fair (default): tenants (API keys) take turns in the waiting queue, share each "
        "step's token budget max-min fairly, and preemption takes from the tenant with the most "
        "running requests; fcfs: first come, first served over all tenants (vLLM's default). "
        "Without keys both plan the same steps.",
    )
    sched.add_argument(
        "--fair-chunk-tokens",
        type=int,
        default=512,
        help="With --scheduling-policy fair, the largest prefill chunk of one request while "
        "several tenants have work (a step lasts as long as its tokens take, and everyone "
        "waits for it); 0: no cap.",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the engine flags; ValueError names a bad value."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            enable_kv_events=args.kv_events,
            max_pinned_blocks=args.max_pinned_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
            fair_chunk_tokens=args.fair_chunk_tokens,
        ),
        kv_store=kv_store_config_from_args(args),
    )


def default_served_name(model: str | None) -> str:
    if model is None:
        from prefixserve.model.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixserve.async_engine import AsyncLLMEngine
    from prefixserve.server.app import build_app
    from prefixserve.server.auth import ApiKeys
    from prefixserve.server.supervision import EngineDeathWatch

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = engine_config_from_args(args)
        check_limit_arguments(args)
        api_keys = ApiKeys.from_options(args.api_key, args.api_key_file, args.admin_api_key_file)
    except (ValueError, OSError) as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2
    served_names = args.served_model_name or [default_served_name(args.model)]
    logger.info("loading %s ...", args.model or "the default model")
    try:
        engine = AsyncLLMEngine.from_config(
            config,
            log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
            collect_kv_events=args.kv_events,
            stall_timeout_s=args.stream_stall_timeout or None,
        )
    except ValueError as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2
    for line in describe_engine(engine, config, served_names):
        logger.info(line)
    pool_tokens = engine.num_kv_blocks * config.cache.block_size
    if pool_tokens < engine.max_model_len:
        logger.warning(
            "the KV pool holds %d tokens, less than max_model_len %d: requests whose prompt + "
            "max_tokens need more are refused (a chat request without max_tokens asks for the "
            "whole context); raise --num-kv-blocks / --kv-cache-memory-gb or lower "
            "--max-model-len",
            pool_tokens,
            engine.max_model_len,
        )
    if api_keys is None:
        logger.info(
            "auth: none (one trusted user: every endpoint open, one cache namespace; see "
            "--api-key-file and --admin-api-key-file)"
        )
    else:
        logger.info(
            "auth: %d API key(s), %d tenant(s), each its own cache namespace; %d operator key(s)",
            len(api_keys),
            len(api_keys.tenants),
            api_keys.num_admin_keys,
        )
        if not api_keys.num_admin_keys:
            logger.warning(
                "no --admin-api-key-file: /kv_events, /reset_prefix_cache, /metrics and the API "
                "docs are unavailable (403)"
            )
    app = build_app(
        engine,
        served_names,
        api_keys=api_keys,
        **app_limits(args),
        admission=admission_from_args(
            args, config.scheduler.max_num_seqs, engine.num_kv_blocks * config.cache.block_size
        ),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            **uvicorn_limits(args),
        )
    )
    death = EngineDeathWatch(engine, server)
    engine.on_dead = death.on_dead
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if death.error is not None else 0


# ------------------------------------------------------------------------------------- bench
@subcommand("bench", "Serving benchmarks: prefixserve beside vLLM and llama.cpp.")
def bench_command(parser: argparse.ArgumentParser) -> Runner:
    try:
        from prefixserve.bench.cli import configure
    except ImportError as exc:  # keep `serve` usable when the benchmark's imports are not
        reason = f"{type(exc).__name__}: {exc}"

        def unavailable(args: argparse.Namespace) -> int:
            print(f"prefixserve bench is unavailable ({reason})", file=sys.stderr)
            return 2

        return unavailable
    return configure(parser)


if __name__ == "__main__":
    sys.exit(main())
