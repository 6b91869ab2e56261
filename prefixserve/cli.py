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

from prefixserve.cluster.options import (
    add_cluster_arguments,
    start_cluster_from_args,
    wants_cluster,
)
from prefixserve.engine.stats_log import describe_engine
from prefixserve.engine_args import (
    EngineArgs,
    add_lora_modules_argument,
    engine_config_from_args,
    lora_modules_from_args,
)
from prefixserve.entrypoints.server.options import (
    add_server_limit_arguments,
    admission_from_args,
    app_limits,
    check_limit_arguments,
    history_from_args,
    uvicorn_limits,
)

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
    EngineArgs.add_cli_args(parser)
    add_lora_modules_argument(parser)
    add_cluster_arguments(parser)
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


def default_served_name(model: str | None) -> str:
    if model is None:
        from prefixserve.model.loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixserve.engine.async_llm import AsyncLLMEngine
    from prefixserve.engine.client import EngineClient
    from prefixserve.entrypoints.api_server import build_app
    from prefixserve.entrypoints.server.auth import ApiKeys
    from prefixserve.entrypoints.server.supervision import EngineDeathWatch

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = engine_config_from_args(args)
        lora_modules = lora_modules_from_args(args)
        check_limit_arguments(args)
        api_keys = ApiKeys.from_options(args.api_key, args.api_key_file, args.admin_api_key_file)
    except (ValueError, OSError) as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2
    served_names = args.served_model_name or [default_served_name(args.model)]
    logger.info("loading %s ...", args.model or "the default model")
    try:
        for name in set(lora_modules) & set(served_names):
            raise ValueError(f"--lora-modules: {name!r} is also a served model name")
        engine: EngineClient
        if wants_cluster(args):
            engine = start_cluster_from_args(args, config)
        else:
            engine = AsyncLLMEngine.from_config(
                config,
                log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
                collect_kv_events=args.enable_kv_events,
                stall_timeout_s=args.stream_stall_timeout or None,
            )
        for name, path in lora_modules.items():  # each checked now, not at its first request
            engine.load_lora_adapter_now(name, path)
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
        lora_modules=lora_modules,
        history=history_from_args(args),
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
