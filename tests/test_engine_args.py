"""One source of engine options: `EngineArgs`' fields make both the `serve` flags and `LLM`'s
keywords, so the two list the same options with the same defaults and build the same config."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from prefixserve import LLM, cli
from prefixserve.engine_args import EngineArgs, engine_config_from_args


def serve_parser():
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command" or a.choices]  # subparsers
    return sub.choices["serve"]


def test_serve_flags_and_llm_keywords_are_the_same_options_with_the_same_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    params = inspect.signature(LLM).parameters
    assert set(params) - {"loaded_model"} == set(fields)
    assert {name: params[name].default for name in fields} == fields
    actions = {a.dest: a for a in serve_parser()._actions}
    assert set(fields) <= set(actions)
    assert {name: actions[name].default for name in fields} == fields


def test_every_option_reaches_the_engine_config_the_same_way_from_both_sides():
    flags = [
        "serve", "m", "--dtype", "float32", "--block-size", "8", "--num-kv-blocks", "99",
        "--kv-events", "--eviction-policy", "slru", "--max-pinned-blocks", "7",
        "--max-num-seqs", "3", "--scheduling-policy", "fcfs", "--fair-chunk-tokens", "64",
        "--admission-order", "longest_prefix", "--no-kv-store", "--enable-lora",
        "--max-loras", "2", "--enable-prompt-embeds", "--no-enable-prefix-caching",
        "--kv-cache-dtype", "int8",
    ]  # fmt: skip
    from_flags = engine_config_from_args(cli.build_parser().parse_args(flags))
    from_keywords = EngineArgs(
        model="m",
        dtype="float32",
        block_size=8,
        num_kv_blocks=99,
        enable_kv_events=True,
        eviction_policy="slru",
        max_pinned_blocks=7,
        max_num_seqs=3,
        scheduling_policy="fcfs",
        fair_chunk_tokens=64,
        admission_order="longest_prefix",
        enable_kv_store=False,
        enable_lora=True,
        max_loras=2,
        enable_prompt_embeds=True,
        enable_prefix_caching=False,
        kv_cache_dtype="int8",
    ).create_engine_config()
    assert from_flags == from_keywords
    assert from_flags.cache.kv_cache_dtype == "int8"
    assert from_flags.cache.max_pinned_blocks == 7 and from_flags.scheduler.fair_chunk_tokens == 64


def test_llm_refuses_an_unknown_option_by_name():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_lora_modules_imply_enable_lora():
    args = cli.build_parser().parse_args(["serve", "--lora-modules", "a=/x", "--no-kv-store"])
    assert engine_config_from_args(args).lora is not None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("enable_kv_store", "false"),
        ("enable_lora", "no"),
        ("enable_prefix_caching", 0),
        ("batch_invariant", "yes"),
        ("num_kv_blocks", 64.0),
        ("max_num_seqs", True),
        ("kv_cache_memory_gb", "1"),
        ("kv_cache_memory_gb", float("nan")),
    ],
)
def test_a_keyword_of_the_wrong_kind_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs(**{name: value}).create_engine_config()


@pytest.mark.parametrize(
    ("name", "value", "flag", "text"),
    [
        ("num_replicas", 0, "--replicas", "0"),
        ("threads_per_replica", 0, "--threads-per-replica", "0"),
        ("kv_cache_memory_gb", float("inf"), "--kv-cache-memory-gb", "inf"),
        ("kv_store_gb", float("inf"), "--kv-store-gb", "inf"),
    ],
)
def test_the_keyword_and_the_flag_refuse_the_same_values_with_the_same_message(
    name, value, flag, text, capsys
):
    import argparse

    from prefixserve import cli
    from prefixserve.engine_args import engine_config_from_args

    with pytest.raises(ValueError) as from_keyword:
        EngineArgs(**{name: value}).create_engine_config()
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(ValueError) as from_flag:
        engine_config_from_args(parser.parse_args([flag, text]))
    assert str(from_flag.value) == str(from_keyword.value)
    assert name in str(from_keyword.value)
    assert cli.main(["serve", flag, text]) == 2  # a message, never a traceback
    assert str(from_keyword.value) in capsys.readouterr().err
