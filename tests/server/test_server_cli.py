"""The `prefixserve` command line: flags, their help, and the config they build."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from prefixserve import cli
from prefixserve.config import EngineConfig

SERVE_FLAGS = [
    "--host",
    "--port",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--prefix-caching-hash-algo",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--num-kv-blocks",
    "--kv-cache-memory-gb",
    "--dtype",
    "--served-model-name",
    "--api-key",
    "--api-key-file",
    "--kv-events",
    "--admin-api-key-file",
    "--max-request-body-bytes",
    "--timeout-keep-alive",
    "--limit-concurrency",
    "--stream-stall-timeout",
    "--max-requests",
    "--max-requests-per-tenant",
    "--max-tokens-per-tenant",
    "--max-render-jobs-per-tenant",
    "--h11-max-incomplete-event-size",
    "--timeout-request-headers",
    "--timeout-request-body",
    "--max-body-bytes-in-flight",
]


def serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_serve_help_explains_every_flag():
    parser = serve_parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for flag in SERVE_FLAGS:
        assert flag in by_flag, flag
        assert by_flag[flag].help and len(by_flag[flag].help) > 15, flag
    text = parser.format_help()
    for flag in SERVE_FLAGS:
        assert flag in text


def test_the_installed_command_prints_help():
    result = subprocess.run(
        [sys.executable, "-m", "prefixserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert "--prefix-caching-hash-algo" in result.stdout
    assert "MODEL" in result.stdout or "model" in result.stdout


def test_flags_build_the_engine_config():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--prefix-caching-hash-algo",
            "xxhash",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "2048",
            "--num-kv-blocks",
            "100",
            "--dtype",
            "float32",
            "--kv-events",
            "--scheduling-policy",
            "fcfs",
            "--fair-chunk-tokens",
            "256",
            "--eviction-policy",
            "slru",
        ]
    )
    config = cli.engine_config_from_args(args)
    assert isinstance(config, EngineConfig)
    assert config.model == "/models/x"
    assert config.dtype == "float32"
    assert config.max_model_len == 2048
    assert config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.cache.prefix_caching_hash_algo == "xxhash"
    assert config.cache.num_kv_blocks == 100
    assert config.cache.enable_kv_events is True
    assert config.scheduler.max_num_seqs == 8
    assert config.scheduler.max_num_batched_tokens == 512
    assert config.scheduler.scheduling_policy == "fcfs"
    assert config.scheduler.fair_chunk_tokens == 256
    assert config.cache.eviction_policy == "slru"


def test_defaults_are_the_default_model_with_prefix_caching_on():
    args = cli.build_parser().parse_args(["serve"])
    config = cli.engine_config_from_args(args)
    assert config.model is None
    assert config.cache.enable_prefix_caching is True
    assert config.scheduler.scheduling_policy == "fair"
    assert args.host == "127.0.0.1" and args.port == 8000
    assert cli.default_served_name(None) == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--dtype", "float16"],
        ["serve", "--prefix-caching-hash-algo", "md5"],
        ["serve", "--num-kv-blocks", "10", "--kv-cache-memory-gb", "1"],
        ["serve", "--port", "eighty"],
        ["serve", "--scheduling-policy", "lifo"],
    ],
)
def test_argparse_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2


def test_bad_values_are_reported_naming_the_field(capsys):
    assert cli.main(["serve", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_a_missing_api_key_file_is_reported(tmp_path, capsys):
    assert cli.main(["serve", "--api-key-file", str(tmp_path / "none")]) == 2
    assert "none" in capsys.readouterr().err


def test_a_subcommand_is_one_registered_function(monkeypatch):
    monkeypatch.setattr(cli, "_SUBCOMMANDS", dict(cli._SUBCOMMANDS))
    seen = {}

    @cli.subcommand("hello", "Say hello.")
    def hello(parser):
        parser.add_argument("--name", default="world")

        def run(args):
            seen["name"] = args.name
            return 0

        return run

    assert cli.main(["hello", "--name", "prefix"]) == 0
    assert seen == {"name": "prefix"}


def test_the_slow_client_flags_reach_uvicorn_and_are_checked():
    from prefixserve.entrypoints.server.options import check_limit_arguments, uvicorn_limits
    from prefixserve.entrypoints.server.slow_clients import HeaderTimeoutH11Protocol

    args = cli.build_parser().parse_args(["serve"])
    assert (args.timeout_request_headers, args.timeout_request_body) == (10.0, 30.0)
    limits = uvicorn_limits(
        cli.build_parser().parse_args(["serve", "--timeout-request-headers", "3"])
    )
    assert issubclass(limits["http"], HeaderTimeoutH11Protocol)
    assert limits["http"].timeout_request_headers_s == 3.0
    for argv in (
        ["--timeout-request-headers", "0"],
        ["--timeout-request-body", "-1"],
        ["--timeout-request-body", "inf"],
        ["--max-body-bytes-in-flight", "-1"],
    ):
        with pytest.raises(ValueError, match=argv[0]):
            check_limit_arguments(cli.build_parser().parse_args(["serve", *argv]))
