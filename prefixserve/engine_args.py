"""The engine's flags of `prefixserve serve` (model, cache, scheduler; vLLM's names where vLLM
has the flag) and the `EngineConfig` they make."""

from __future__ import annotations

import argparse
import json

from prefixserve.config import (
    ADMISSION_ORDERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from prefixserve.dtypes import SUPPORTED_DTYPES
from prefixserve.kv_cache.eviction import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from prefixserve.kv_cache.hashing import HASH_ALGOS
from prefixserve.kv_store.options import kv_store_config_from_args
from prefixserve.lora.config import LoRAConfig, check_lora_name


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
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        default=DEFAULT_EVICTION_POLICY,
        help="Which free cached block the pool reuses first: lru (least recently freed), slru "
        "(segmented LRU: blocks hit again are protected), cost (reuse x recompute cost, aged).",
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
        "--admission-order",
        choices=ADMISSION_ORDERS,
        default="fcfs",
        help="fcfs: each tenant's waiting requests in arrival order; longest_prefix: the one with "
        "the longest cached prefix among its first 16 first, any request passed over 16 times "
        "first (aging).",
    )
    sched.add_argument(
        "--fair-chunk-tokens",
        type=int,
        default=512,
        help="With --scheduling-policy fair, the largest prefill chunk of one request while "
        "several tenants have work (a step lasts as long as its tokens take, and everyone "
        "waits for it); 0: no cap.",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='Speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": '
        "5}' (n-gram drafts from the request's own tokens, verified in one forward pass; "
        "outputs are the same as without). Off by default.",
    )
    lora = parser.add_argument_group("LoRA adapters and prompt embeddings")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters: a request names one in `model` (implied by --lora-modules).",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories to serve, each as name=path or vLLM's JSON "
        '\'{"name": ..., "path": ...}\'; more can be loaded at run time through the operator '
        "route POST /v1/load_lora_adapter.",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="Adapters loaded at once (one step batches requests of all of them with the base "
        "model's); an adapter not loaded is loaded when a request names it, in place of the "
        "least recently used one that no request is using.",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=16, help="The largest adapter rank accepted."
    )
    lora.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="Let /v1/completions take `prompt_embeds` (base64 of torch.save bytes of a "
        "[num_tokens, hidden_size] float tensor) instead of `prompt`.",
    )


def lora_modules_from_args(args: argparse.Namespace) -> dict[str, str]:
    """--lora-modules as name -> path; ValueError for a malformed entry or a repeated name."""
    modules: dict[str, str] = {}
    for entry in args.lora_modules:
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"--lora-modules: {entry!r} is not JSON with 'name' and 'path'"
                ) from None
        else:
            name, sep, path = entry.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {entry!r} is not name=path")
        check_lora_name(name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {entry!r} has no path")
        if name in modules:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules[name] = path
    return modules


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
            eviction_policy=args.eviction_policy,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
            fair_chunk_tokens=args.fair_chunk_tokens,
            admission_order=args.admission_order,
        ),
        kv_store=kv_store_config_from_args(args),
        speculative_config=args.speculative_config,
        lora=(
            LoRAConfig(args.max_loras, args.max_lora_rank)
            if args.enable_lora or args.lora_modules
            else None
        ),
        enable_prompt_embeds=args.enable_prompt_embeds,
    )
