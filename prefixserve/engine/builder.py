"""Building an engine's parts, each through its constructor (vLLM's engine-core set-up): the
model (loaded, or checked against the config), the KV pool's size, the KV-cache manager, the
LoRA manager, the model runner, the tiers below RAM and the hash chain's seed they give, the
cache explainer, the scheduler and the structured-output manager (grammars).
`build_engine_parts` returns them as one `EngineParts`; `LLMEngine` holds them and runs the
step loop over them. No part is wired to another by setting an attribute after its
construction: what a part uses is an argument of its constructor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixserve.config import (
    DEFAULT_KV_CACHE_MEMORY_GB,
    KV_CACHE_DTYPES,
    EngineConfig,
    SpeculativeConfig,
)
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.reports.explain import CacheExplainer
from prefixserve.core.kv_cache.sizing import blocks_needed, size_kv_pool
from prefixserve.core.kv_cache.spec import KVCacheConfig, KVCacheSpec
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.kv_store.connector import KVStoreConnector
from prefixserve.kv_store.open_tiers import open_engine_kv_store
from prefixserve.kv_store.worker import kv_layout, layout_string
from prefixserve.lora.manager import LoRAManager
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader.loading import LoadedModel, load_model
from prefixserve.model.quant.kv_cache import kv_format
from prefixserve.spec_decode.ngram import NgramProposer
from prefixserve.structured_output.manager import StructuredOutputManager
from prefixserve.worker.model_runner import ModelRunner


@dataclass(slots=True)
class EngineParts:
    """An engine's parts, built and connected (`build_engine_parts`)."""

    loaded_model: LoadedModel
    max_model_len: int
    kv_cache_groups: list[KVCacheSpec]
    num_kv_blocks: int
    max_chunk: int  # the most tokens one request computes in one step
    kv_cache_manager: KVCacheManager
    lora: LoRAManager | None
    runner: ModelRunner
    kv_connector: KVStoreConnector | None
    none_hash: bytes | None  # the tiers' chain seed (None: the process's)
    block_hasher: Callable[[Any], list[bytes]]
    explainer: CacheExplainer
    scheduler: Scheduler
    structured_outputs: StructuredOutputManager

    def blocks_needed(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of `num_tokens` cached tokens holds at once."""
        block_size = self.kv_cache_manager.block_size
        return blocks_needed(self.kv_cache_groups, num_tokens, block_size, self.max_chunk)


def build_engine_parts(config: EngineConfig, loaded_model: LoadedModel | None) -> EngineParts:
    """Every part of an engine for `config`, over `loaded_model` (loaded here when None; it
    must match `config.dtype`). ValueError names a config the model cannot serve."""
    loaded_model = _checked_model(config, loaded_model)
    model_config = loaded_model.config
    max_model_len = _max_model_len(config, model_config)
    groups = list(model_config.kv_cache_groups())
    max_chunk = _max_chunk(config)
    num_kv_blocks = _num_kv_blocks(config, model_config, groups, max_model_len, max_chunk)
    manager = _kv_cache_manager(config, groups, num_kv_blocks)
    lora = None
    if config.lora is not None:
        lora = LoRAManager(loaded_model.model, model_config, config.lora)
    cache = config.cache
    runner = ModelRunner(
        loaded_model.model,
        model_config,
        num_blocks=num_kv_blocks + 1,
        block_size=cache.block_size,
        seed=config.seed,
        batch_invariant=config.batch_invariant,
        kv_cache_dtype=cache.kv_cache_dtype,
        lora=lora,
    )
    connector, none_hash = open_engine_kv_store(
        config,
        loaded_model.path,
        groups,
        kv_layout(runner.kv_caches, runner.kv_format.name),
        runner.kv_numerics(),
        _other_kv_layouts(runner, model_config),
    )
    try:
        block_hasher = get_request_block_hasher(
            cache.block_size, cache.prefix_caching_hash_algo, none_hash=none_hash
        )
        # Every request's cache report, at its first scheduling (kv_cache/reports/).
        explainer = CacheExplainer(manager, manager.recorder, block_hasher, disk=connector)
        scheduler = _scheduler(config, loaded_model, manager, max_model_len, connector, explainer)
    except BaseException:
        if connector is not None:  # its writers and connections are started: stop them
            connector.close()
        raise
    return EngineParts(
        loaded_model,
        max_model_len,
        groups,
        num_kv_blocks,
        max_chunk,
        manager,
        lora,
        runner,
        connector,
        none_hash,
        block_hasher,
        explainer,
        scheduler,
        StructuredOutputManager(
            loaded_model.tokenizer.hf_tokenizer,
            loaded_model.tokenizer.vocab_size,
            scheduler.eos_token_ids,
            config.structured_outputs,
            logits_width=model_config.vocab_size,
        ),
    )


def close_with(owner: object, connector: KVStoreConnector | None) -> None:
    """Queued tier writes reach the disk when `owner` is collected or the process exits."""
    if connector is not None:
        weakref.finalize(owner, connector.close)


def _checked_model(config: EngineConfig, loaded_model: LoadedModel | None) -> LoadedModel:
    if loaded_model is None:
        return load_model(
            config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            quantization=config.quantization,
        )
    if loaded_model.config.dtype != config.dtype:
        raise ValueError(
            f"dtype={config.dtype!r} but the given model was loaded in "
            f"{loaded_model.config.dtype!r}"
        )
    return loaded_model


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    model_len = model_config.max_model_len
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(
            f"max_model_len must be at most the model's context length {model_len}, "
            f"got {config.max_model_len}"
        )
    return config.max_model_len or model_len


def _max_chunk(config: EngineConfig) -> int:
    """The most tokens one request computes in one step (a prefill or recompute chunk)."""
    sched = config.scheduler
    threshold = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
    return min(sched.max_num_batched_tokens, threshold)


def _num_kv_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    groups: list[KVCacheSpec],
    max_model_len: int,
    max_chunk: int,
) -> int:
    cache = config.cache
    return size_kv_pool(
        num_kv_blocks=cache.num_kv_blocks,
        kv_cache_memory_gb=cache.kv_cache_memory_gb,
        default_memory_gb=DEFAULT_KV_CACHE_MEMORY_GB,
        bytes_per_block=model_config.kv_cache_bytes_per_block(
            cache.block_size, kv_format(cache.kv_cache_dtype, model_config.torch_dtype)
        ),
        max_num_seqs=config.scheduler.max_num_seqs,
        blocks_per_request=blocks_needed(groups, max_model_len, cache.block_size, max_chunk),
    )


def _kv_cache_manager(
    config: EngineConfig, groups: list[KVCacheSpec], num_kv_blocks: int
) -> KVCacheManager:
    cache = config.cache
    kv_config = KVCacheConfig(
        num_blocks=num_kv_blocks + 1,
        block_size=cache.block_size,
        groups=groups,
        hash_algo=cache.prefix_caching_hash_algo,
    )
    return KVCacheManager(
        kv_config,
        enable_caching=cache.enable_prefix_caching,
        enable_kv_cache_events=cache.enable_kv_events,
        max_pinned_blocks=(
            num_kv_blocks // 4 if cache.max_pinned_blocks is None else cache.max_pinned_blocks
        ),
        eviction_policy=cache.eviction_policy,
        ghost_entries=cache.cache_ghost_entries,
        max_breakpoint_blocks=cache.max_breakpoint_blocks,
        max_breakpoint_blocks_per_tenant=cache.max_breakpoint_blocks_per_tenant,
    )


def _scheduler(
    config: EngineConfig,
    loaded_model: LoadedModel,
    manager: KVCacheManager,
    max_model_len: int,
    connector: KVStoreConnector | None,
    explainer: CacheExplainer,
) -> Scheduler:
    eos_ids = set(loaded_model.tokenizer.eos_token_ids) | set(loaded_model.config.eos_token_ids)
    spec = config.speculative_config
    assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig parsed it
    return Scheduler(
        config.scheduler,
        manager,
        max_model_len,
        eos_token_ids=eos_ids,
        proposer=NgramProposer(spec) if spec is not None else None,
        kv_connector=connector,
        explainer=explainer,
    )


def _other_kv_layouts(runner: ModelRunner, model_config: ModelConfig) -> dict[str, str]:
    """The disk layouts of this model's other KV dtypes (`kv_layout` and `kv_numerics` as an
    engine of that dtype would build them), for cache reports that name a block stored in
    another."""
    k_cache = runner.kv_caches[0][0]
    _, block_size, heads, _ = k_cache.shape
    head_dim, own = model_config.head_dim, runner.kv_format.name
    layouts = {}
    for name in KV_CACHE_DTYPES:
        try:
            fmt = kv_format(name, model_config.torch_dtype)
        except ValueError:
            continue  # not a format of this model's dtype
        if fmt.name != own:
            layouts[fmt.name] = layout_string(
                len(runner.kv_caches),
                block_size,
                heads,
                fmt.row_width(head_dim),
                fmt.storage,
                fmt.name,
            ) + runner.kv_numerics(fmt.name)
    return layouts
