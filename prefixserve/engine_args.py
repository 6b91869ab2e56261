"""Every engine option, once: `EngineArgs`, whose fields make both the `prefixserve serve` flags
(`add_cli_args`, vLLM's names where vLLM has the flag) and the `LLM(...)` keywords, and the
`EngineConfig` they ask for (`create_engine_config`), as vLLM's `EngineArgs` does.

A field's metadata (`option(...)`) holds its help, its flag when the flag's name is not the
field's (`--kv-events` for `enable_kv_events`), its argparse group and choices. Options only a
server has (address, keys, limits, the adapters it serves at start-up, Ray deployment) stay with
the server's and the cluster's flags.

Longer than 700 lines because it declares every engine option once, each with its help text (the
flag's documentation): split by group, the one list of options would live in several files.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prefixserve.settings as settings
from prefixserve.cluster.policy import DEFAULT_POLICY, POLICIES
from prefixserve.config import (
    ADMISSION_ORDERS,
    DEFAULT_GHOST_ENTRIES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    RETENTION_SECONDS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    LoRAConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from prefixserve.core.kv_cache.eviction.policies import (
    DEFAULT_EVICTION_POLICY,
    EVICTION_POLICIES,
    check_eviction_policy,
)
from prefixserve.core.kv_cache.hashing import HASH_ALGOS, get_hash_fn
from prefixserve.dtypes import SUPPORTED_DTYPES
from prefixserve.kv_store import capacity_from_gb
from prefixserve.kv_store.remote.lookup import check_url, read_password
from prefixserve.kv_store.tier_key import read_key_file
from prefixserve.lora.config import check_lora_name


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`'s text: a file's contents, or the value itself when it is a template
    (it has Jinja's {{ or {%). ValueError names a path that cannot be read."""
    if value is None or "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"chat_template: cannot read {value!r}: {exc.strerror}") from None


def option(
    default: Any,
    help: str,  # noqa: A002 - argparse's word
    *,
    group: str,
    flag: str | None = None,
    choices: typing.Sequence[Any] | None = None,
    metavar: str | None = None,
    exclusive: str | None = None,
    minimum: int | None = None,
) -> Any:
    """A field of `EngineArgs` with what its flag needs; fields of one `exclusive` name may not
    be given together; a number field's `minimum`, checked as its kind is (`_check_kinds`)."""
    meta = {
        "help": help,
        "group": group,
        "flag": flag,
        "choices": choices,
        "metavar": metavar,
        "exclusive": exclusive,
        "minimum": minimum,
    }
    return field(default=default, metadata=meta)


_ENGINE = "engine"
_CACHE = "KV cache and prefix caching"
_SCHED = "scheduler"
_STORE = "KV store (the prefix cache's disk tier)"
_LORA = "LoRA adapters, prompt embeddings, speculative decoding"
_REPLICAS = "replicas (Ray)"
_STRUCTURED = "structured outputs"


@dataclass(kw_only=True)
class EngineArgs:
    """The engine's options; invalid values raise ValueError in `create_engine_config`."""

    model: str | None = option(
        None,
        "A Hugging Face model directory or a .gguf file. Default: the packaged default model "
        "(SmolLM2-135M-Instruct), converted on first use.",
        group=_ENGINE,
    )
    dtype: str = option(
        "bfloat16",
        "Weights and KV-cache dtype (float16 is not supported on the CPU).",
        group=_ENGINE,
        choices=SUPPORTED_DTYPES,
    )
    quantization: str = option(
        "auto",
        "How the weights are held: auto (a GGUF file's Q8_0 weights stay 8-bit, decoded in "
        "registers; the rest in --dtype), none (every weight in --dtype), int8 (also every other "
        "linear as int8 per output channel, computed once and cached on disk). 8-bit weights "
        "need --dtype bfloat16.",
        group=_ENGINE,
        choices=QUANTIZATIONS,
    )
    max_model_len: int | None = option(
        None, "Context length (prompt + output tokens). Default: the model's own.", group=_ENGINE
    )
    seed: int = option(0, "Seed of the sampler.", group=_ENGINE)
    batch_invariant: bool | None = option(
        None,
        "Batch-invariant execution: each request's tokens and logprobs do not depend on the "
        "other requests of its step, on how its prompt was chunked or on whether its K/V came "
        "from the cache, so a prefix-cache hit gives the cold start's bf16 output bit for bit "
        "(one linear and one attention kernel for every row count; needs the native kernels). "
        "Default: VLLM_BATCH_INVARIANT, else on for bf16 models wherever the native kernels "
        "run (--no-batch-invariant leaves it).",
        group=_ENGINE,
        flag="--batch-invariant",
    )
    block_size: int = option(
        16,
        "Tokens per KV-cache block; the unit of prefix-cache reuse (only full blocks are shared).",
        group=_CACHE,
    )
    enable_prefix_caching: bool = option(
        True,
        "Reuse the KV blocks of prompt prefixes seen before (automatic prefix caching).",
        group=_CACHE,
    )
    prefix_caching_hash_algo: str = option(
        "sha256",
        "Hash chaining the block contents: sha256 (collision-resistant, the safe choice when "
        "tenants share a server) or xxhash (faster, not cryptographic).",
        group=_CACHE,
        choices=HASH_ALGOS,
    )
    num_kv_blocks: int | None = option(
        None,
        "Size of the KV-cache pool in blocks (vLLM: --num-gpu-blocks-override). Default: sized "
        "from --kv-cache-memory-gb.",
        group=_CACHE,
        exclusive="pool size",
    )
    kv_cache_memory_gb: float | None = option(
        None,
        "Memory for the KV-cache pool in GiB. Default: 1 GiB, or less when max-num-seqs requests "
        "at full context need less.",
        group=_CACHE,
        exclusive="pool size",
    )
    kv_cache_dtype: str = option(
        "auto",
        "How the KV cache stores K/V: auto (the model's dtype), bf16, or 8 bits a value with an "
        "fp32 scale per token and KV head, int8 or fp8_e4m3 (about 1.9x the tokens in the same "
        "memory and disk; vLLM's flag).",
        group=_CACHE,
        choices=KV_CACHE_DTYPES,
    )
    enable_kv_events: bool = option(
        False,
        "Record KV-cache events (blocks stored, evicted, cache cleared), served at GET "
        "/kv_events for KV-aware routers.",
        group=_CACHE,
        flag="--kv-events",
    )
    eviction_policy: str = option(
        DEFAULT_EVICTION_POLICY,
        "Which free cached block the pool reuses first: lru (least recently freed), slru "
        "(segmented LRU: blocks hit again are protected), cost (reuse x recompute cost, aged).",
        group=_CACHE,
        choices=EVICTION_POLICIES,
    )
    cache_ghost_entries: int = option(
        DEFAULT_GHOST_ENTRIES,
        "Evicted block hashes remembered, so a cache report can tell 'evicted' from "
        "'never_seen' (about 250 bytes each; 0: none). The start-up log shows the bound.",
        group=_CACHE,
    )
    max_pinned_blocks: int | None = option(
        None,
        "Most KV blocks operators may pin with POST /pins (default: a quarter of the pool).",
        group=_CACHE,
    )
    max_breakpoint_blocks: int | None = option(
        None,
        "Most KV blocks clients' cache breakpoints (Anthropic's cache_control, OpenAI's 24h "
        "retention) may hold in all (default: half the pool).",
        group=_CACHE,
    )
    max_breakpoint_blocks_per_tenant: int | None = option(
        None,
        "Most KV blocks one tenant's cache breakpoints may hold; past it the tenant's own "
        "soonest-expiring breakpoints age out (default: a quarter of the pool).",
        group=_CACHE,
    )
    max_num_seqs: int = option(256, "Most requests running in one step.", group=_SCHED)
    max_num_batched_tokens: int = option(
        4096,
        "Most tokens computed in one step (prefill chunks plus one per decoding request).",
        group=_SCHED,
    )
    long_prefill_token_threshold: int = option(
        0,
        "Cap on one request's prefill chunk per step, so long prompts do not stall the others "
        "(0: no cap).",
        group=_SCHED,
    )
    scheduling_policy: str = option(
        "fair",
        "fair (default): tenants (API keys) take turns in the waiting queue, share each step's "
        "token budget max-min fairly, and preemption takes from the tenant with the most running "
        "requests; fcfs: first come, first served over all tenants (vLLM's default). Without "
        "keys both plan the same steps.",
        group=_SCHED,
        choices=SCHEDULING_POLICIES,
    )
    admission_order: str = option(
        "fcfs",
        "fcfs: each tenant's waiting requests in arrival order; longest_prefix: the one with the "
        "longest cached prefix among its first 16 first, any request passed over 16 times first "
        "(aging).",
        group=_SCHED,
        choices=ADMISSION_ORDERS,
    )
    fair_chunk_tokens: int = option(
        512,
        "With --scheduling-policy fair, the largest prefill chunk of one request while several "
        "tenants have work (a step lasts as long as its tokens take, and everyone waits for "
        "it); 0: no cap.",
        group=_SCHED,
    )
    enable_kv_store: bool | None = option(
        None,
        "The prefix cache's disk tier. Default: on (off where PREFIXSERVE_KV_STORE=0, unless "
        "--kv-store-dir or --kv-store-gb is given); --no-kv-store: cached blocks live in the "
        "RAM pool only and die with the process.",
        group=_STORE,
        flag="--kv-store",
    )
    kv_store_dir: str | None = option(
        None,
        "Directory of the disk tier, shared by the servers of one user on this host (default: "
        f"{settings.kv_store_root()}). Created 0700; its files are 0600.",
        group=_STORE,
        metavar="DIR",
    )
    kv_remote: str | None = option(
        None,
        "A KV tier shared by every host on a Redis or Valkey server (redis://host:port/db, "
        "rediss:// with TLS, or unix:///path.sock): blocks one host computed load on the "
        "others; faults are misses. With the disk tier or without it (--no-kv-store). Run its "
        "server with maxmemory-policy allkeys-lru.",
        group=_STORE,
        metavar="URL",
    )
    kv_load_overlap: bool = option(
        True,
        "Read a request's blocks from the disk or shared tier on a thread of their own while "
        "the running requests compute, when the read was measured to outlast a step; the "
        "request waits meanwhile (stalls of the running requests' tokens halve, its own first "
        "token comes later). --no-kv-load-overlap: read them when the request is admitted, on "
        "the step thread.",
        group=_STORE,
    )
    kv_remote_password_file: str | None = option(
        None,
        "File holding the --kv-remote server's password (never on the command line).",
        group=_STORE,
        metavar="PATH",
    )
    kv_remote_key_file: str | None = option(
        None,
        "File (mode 600) holding the secret every host of the deployment shares, 32 bytes or "
        "more (openssl rand -hex 32): each value on the --kv-remote server carries its MAC, so "
        "whoever can write to the server cannot change an answer, and the hosts' hash seed "
        "derives from it. Required with --kv-remote; never sent to the server.",
        group=_STORE,
        metavar="PATH",
    )
    kv_store_key_file: str | None = option(
        None,
        "File (mode 600) holding a secret of 32 bytes or more for the disk tier, where its "
        "directory is shared with other hosts: its records carry a MAC under it instead of a "
        "checksum, and its hash seed derives from it instead of the directory's seed file.",
        group=_STORE,
        metavar="PATH",
    )
    kv_store_gb: float | None = option(
        None,
        "Most disk the tier may use, over all models in the directory; least recently used "
        "blocks are deleted past it (default: a quarter of the free disk, at most 32).",
        group=_STORE,
        metavar="GIB",
    )
    kv_store_default_retention: str = option(
        "24h",
        "Retention of a request without prompt_cache_retention: 24h writes its blocks to disk "
        "for up to 24 hours; in_memory never writes them.",
        group=_STORE,
        choices=tuple(RETENTION_SECONDS),
    )
    speculative_config: str | dict | None = option(
        None,
        'Speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
        "(n-gram drafts from the request's own tokens, verified in one forward pass; outputs "
        "are the same as without). Off by default.",
        group=_LORA,
        metavar="JSON",
    )
    chat_template: str | None = option(
        None,
        "A Jinja chat template, as a file path or the template's text, used instead of the "
        "model's own (for chats and, where it renders tools, for tool calls; otherwise tools "
        "use the packaged template of the model's family).",
        group=_ENGINE,
        metavar="FILE",
    )
    structured_outputs_compile_timeout: float = option(
        5.0,
        "Seconds a request waits for its grammar (JSON Schema, regex, choice, Lark) to "
        "compile; past it the request gets a 400 (the compile, bounded by the grammar "
        "engine's limits, finishes on its thread and is dropped).",
        group=_STRUCTURED,
        metavar="SECONDS",
    )
    structured_outputs_jump_forward: bool = option(
        True,
        'Append the tokens a grammar forces (`{"name":"`, closing brackets, enum tails) '
        "at once and compute them as one chunk instead of one decode step each (the same "
        "tokens either way).",
        group=_STRUCTURED,
    )
    max_grammar_compiles_per_tenant: int = option(
        4,
        "Grammar compiles one client (API key) may have in flight; one more is a 429.",
        group=_STRUCTURED,
        minimum=1,
    )
    max_cached_grammar_chars: int = option(
        16 << 20,
        "Characters of constraint text (schemas, grammars) whose compiled grammars are cached "
        "in all; a compiled grammar takes up to ~75 bytes of memory per character, so the "
        "default bounds the cache near 1.2 GB. Least recently used out first.",
        group=_STRUCTURED,
        minimum=1,
    )
    max_cached_grammars_per_tenant: int = option(
        256,
        "Compiled grammars cached per client (API key; never shared between clients), least "
        "recently used out first.",
        group=_STRUCTURED,
        minimum=1,
    )
    enable_lora: bool = option(
        False,
        "Serve LoRA adapters: a request names one in `model` (implied by --lora-modules).",
        group=_LORA,
    )
    max_loras: int = option(
        4,
        "Adapters loaded at once (one step batches requests of all of them with the base "
        "model's); an adapter not loaded is loaded when a request names it, in place of the "
        "least recently used one that no request is using.",
        group=_LORA,
    )
    max_lora_rank: int = option(16, "The largest adapter rank accepted.", group=_LORA)
    enable_prompt_embeds: bool = option(
        False,
        "Take `prompt_embeds` (a [num_tokens, hidden_size] float tensor; over HTTP base64 of "
        "torch.save bytes) instead of a prompt's token ids.",
        group=_LORA,
    )
    num_replicas: int = option(
        1,
        "Engine replicas, each a Ray actor with its own KV pool, behind this one endpoint; "
        "requests go where their prefix is cached (--routing-policy). 1: one in-process engine, "
        "no Ray.",
        group=_REPLICAS,
        flag="--replicas",
        metavar="N",
        minimum=1,
    )
    threads_per_replica: int = option(
        1, "CPU threads (and Ray CPUs) of each replica.", group=_REPLICAS, metavar="T", minimum=1
    )
    routing_policy: str = option(
        DEFAULT_POLICY,
        "prefix: the replica where the prompt's cached prefix makes the work least, weighed "
        "against its load (from the replicas' KV events); the others are baselines.",
        group=_REPLICAS,
        choices=sorted(POLICIES),
    )

    # ------------------------------------------------------------------ the config

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig these options ask for; ValueError names a bad value
        (the records' own checks, then the names the registries of core/ must know)."""
        _check_kinds(self)
        self._check_exclusive()
        config = self._engine_config()
        check_registered_names(config)
        return config

    def _engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_gb=self.kv_cache_memory_gb,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                enable_kv_events=self.enable_kv_events,
                max_pinned_blocks=self.max_pinned_blocks,
                max_breakpoint_blocks=self.max_breakpoint_blocks,
                max_breakpoint_blocks_per_tenant=self.max_breakpoint_blocks_per_tenant,
                eviction_policy=self.eviction_policy,
                cache_ghost_entries=self.cache_ghost_entries,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                scheduling_policy=self.scheduling_policy,
                fair_chunk_tokens=self.fair_chunk_tokens,
                admission_order=self.admission_order,
            ),
            kv_store=self._kv_store_config(),
            speculative_config=self.speculative_config,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank) if self.enable_lora else None,
            enable_prompt_embeds=self.enable_prompt_embeds,
            batch_invariant=self._batch_invariant(),
            quantization=self.quantization,
            chat_template=read_chat_template(self.chat_template),
            structured_outputs=StructuredOutputsConfig(
                compile_timeout_s=self.structured_outputs_compile_timeout,
                jump_forward=self.structured_outputs_jump_forward,
                max_compiles_per_tenant=self.max_grammar_compiles_per_tenant,
                max_cached_grammars_per_tenant=self.max_cached_grammars_per_tenant,
                max_cached_grammar_chars=self.max_cached_grammar_chars,
            ),
        )

    def _batch_invariant(self) -> bool | None:
        """`batch_invariant` as given, else VLLM_BATCH_INVARIANT's, else None: the runner's
        default (on for bf16 wherever it can be)."""
        if self.batch_invariant is not None:
            return self.batch_invariant
        return settings.batch_invariant_env()

    def _check_exclusive(self) -> None:
        given: dict[str, list[str]] = {}
        for f in dataclasses.fields(self):
            if f.metadata["exclusive"] and getattr(self, f.name) != f.default:
                given.setdefault(f.metadata["exclusive"], []).append(f.name)
        for names in given.values():
            if len(names) > 1:
                raise ValueError(f"give at most one of {', '.join(names)}")

    def _kv_store_config(self) -> KVStoreConfig | None:
        """The tiers below the RAM pool asked for: the disk tier (`enable_kv_store`, or when
        unset, on if a directory or size is given, else the environment's default,
        PREFIXSERVE_KV_STORE) and the shared tier (`kv_remote`), each without the other."""
        enabled = self.enable_kv_store
        if enabled is None:
            explicit = self.kv_store_dir is not None or self.kv_store_gb is not None
            explicit = explicit or self.kv_store_key_file is not None
            enabled = explicit or settings.kv_store_default_enabled()
        self._check_tier_flags(enabled)
        if not enabled and self.kv_remote is None:
            return None
        self._check_store_files()
        return KVStoreConfig(
            dir=None if self.kv_store_dir is None else Path(self.kv_store_dir),
            capacity_bytes=None if self.kv_store_gb is None else capacity_from_gb(self.kv_store_gb),
            enabled=enabled,
            default_retention=self.kv_store_default_retention,
            remote_url=self.kv_remote,
            remote_password_file=self.kv_remote_password_file,
            remote_key_file=self.kv_remote_key_file,
            key_file=self.kv_store_key_file,
            overlap_loads=self.kv_load_overlap,
        )

    def _check_tier_flags(self, disk_enabled: bool) -> None:
        """ValueError for a tier's file flag without its tier (it would be silently ignored)."""
        if self.kv_remote is None:
            for flag, value in (
                ("--kv-remote-key-file", self.kv_remote_key_file),
                ("--kv-remote-password-file", self.kv_remote_password_file),
            ):
                if value is not None:
                    raise ValueError(f"{flag} needs --kv-remote (the shared tier it is for)")
        if self.kv_store_key_file is not None and not disk_enabled:
            raise ValueError("--kv-store-key-file needs the disk tier (--no-kv-store turns it off)")

    def _check_store_files(self) -> None:
        """The shared tier's URL, password and key files, and the disk's key file, checked now
        (before any model loads): ValueError naming the flag."""
        if self.kv_remote is not None:
            check_url(self.kv_remote)
            read_password(self.kv_remote_password_file)
            if self.kv_remote_key_file is not None:
                read_key_file(self.kv_remote_key_file, "--kv-remote-key-file")
        if self.kv_store_key_file is not None:
            read_key_file(self.kv_store_key_file, "--kv-store-key-file")

    # ------------------------------------------------------------------ the flags

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field (`model` is the positional MODEL), in its group."""
        groups: dict[str, Any] = {}
        for f in dataclasses.fields(EngineArgs):
            meta = f.metadata
            if f.name == "model":
                parser.add_argument("model", nargs="?", default=None, help=meta["help"])
                continue
            group = groups.get(meta["group"]) or parser.add_argument_group(meta["group"])
            groups[meta["group"]] = group
            if meta["exclusive"]:
                key = ("exclusive", meta["exclusive"])
                group = groups.get(key) or group.add_mutually_exclusive_group()
                groups[key] = group
            group.add_argument(_flag(f), dest=f.name, **_argparse_kwargs(f))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options the parsed flags give."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _check_kinds(args: EngineArgs) -> None:
    """ValueError naming the first option whose value is not of its kind: a bool option takes
    True or False (not "false", not 0), an int option an int (not a bool, not 64.0), a float
    option a finite number, each at least its `minimum`; None where the option allows it. The
    same check, with the same message, for an `LLM(...)` keyword and a `serve` flag."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        kinds = _kinds(hints[f.name])
        if value is None and type(None) in kinds:
            continue
        problem = _kind_problem(value, kinds, f.metadata["minimum"])
        if problem is not None:
            name = f.name if f.name == "model" else f"{f.name} ({_flag(f)})"
            raise ValueError(f"{name} must be {problem}, got {value!r}")


def _kinds(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _kind_problem(value: Any, kinds: tuple[Any, ...], minimum: int | None) -> str | None:
    """What `value` must be when it is not of `kinds` (bool, int or float options only; other
    kinds are their records' to check), else None."""
    if bool in kinds:
        return None if isinstance(value, bool) else "True or False"
    if int in kinds:
        wanted = "an integer"
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif float in kinds:
        wanted = "a finite number"
        fits = isinstance(value, int | float) and not isinstance(value, bool)
        fits = fits and math.isfinite(value)
    else:
        return None
    if fits and (minimum is None or value >= minimum):
        return None
    return wanted if minimum is None else f"{wanted} >= {minimum}"


def check_registered_names(config: EngineConfig) -> None:
    """ValueError unless the names `config` gives are registered: the prefix cache's hash
    function and eviction policy (config.py's records hold names only)."""
    try:
        get_hash_fn(config.cache.prefix_caching_hash_algo)
    except ValueError as e:
        raise ValueError(f"prefix_caching_hash_algo: {e}") from None
    check_eviction_policy(config.cache.eviction_policy)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _argparse_kwargs(f: dataclasses.Field) -> dict[str, Any]:
    meta, kind = f.metadata, _value_type(f)
    kwargs: dict[str, Any] = {"default": f.default, "help": meta["help"]}
    if kind is bool:
        # A flag that turns on what is off; on (or unset) by default: --x / --no-x.
        kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        return kwargs
    if kind is not str:
        kwargs["type"] = kind
    if meta["choices"] is not None:
        kwargs["choices"] = meta["choices"]
    if meta["metavar"] is not None:
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def _value_type(f: dataclasses.Field) -> type:
    """The flag's value type: the field's annotation less None (a JSON option is a str)."""
    hints = typing.get_type_hints(EngineArgs)
    annotation = hints[f.name]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0]
    return annotation if annotation in (bool, int, float, str) else str


def engine_args_signature(*extra: inspect.Parameter) -> list[inspect.Parameter]:
    """Keyword parameters for every field (`model` positional first), then `extra`: for the
    signature of `LLM(...)`."""
    hints = typing.get_type_hints(EngineArgs)
    params = []
    for f in dataclasses.fields(EngineArgs):
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if f.name == "model"
            else inspect.Parameter.KEYWORD_ONLY
        )
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]))
    return params + list(extra)


def add_lora_modules_argument(parser: argparse.ArgumentParser) -> None:
    """--lora-modules: the adapters a server serves from its start (it implies --enable-lora)."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories to serve, each as name=path or vLLM's JSON "
        '\'{"name": ..., "path": ...}\'; more can be loaded at run time through the operator '
        "route POST /v1/load_lora_adapter.",
    )


def lora_modules_from_args(args: argparse.Namespace) -> dict[str, str]:
    """--lora-modules as name -> path; ValueError for a malformed entry or a repeated name."""
    modules: dict[str, str] = {}
    for entry in args.lora_modules:
        name, path = _lora_module(entry)
        check_lora_name(name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {entry!r} has no path")
        if name in modules:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules[name] = path
    return modules


def _lora_module(entry: str) -> tuple[Any, Any]:
    if entry.lstrip().startswith("{"):
        try:
            spec = json.loads(entry)
            return spec["name"], spec["path"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f"--lora-modules: {entry!r} is not JSON with 'name' and 'path'"
            ) from None
    name, sep, path = entry.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules: {entry!r} is not name=path")
    return name, path


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the engine flags (--lora-modules implies --enable-lora); ValueError
    names a bad value."""
    engine_args = EngineArgs.from_cli_args(args)
    if getattr(args, "lora_modules", None):
        engine_args.enable_lora = True
    return engine_args.create_engine_config()
