"""Validated configuration records for the engine: cache, scheduler, disk tier, LoRA,
speculative decoding, and the engine as a whole.

Every field a user can set is checked on construction; a bad value raises ValueError naming the
field, the value and what is allowed. The records hold plain values and names, and this module
is the bottom floor: it imports nothing of core/, kv_store/, lora/ or spec_decode/ (they import
it). Checks against those rooms' registries (the hash functions, the eviction policies) are made
where a config is created from the options, `EngineArgs.create_engine_config`, and again by the
room that uses the name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.dtypes import SUPPORTED_DTYPES

# Without num_kv_blocks or kv_cache_memory_gb the pool gets this much memory (or less, when the
# model's context needs less for max_num_seqs requests).
DEFAULT_KV_CACHE_MEMORY_GB = 1.0
# Evicted block hashes the cache reports remember (core/kv_cache/reports/ghost.py).
DEFAULT_GHOST_ENTRIES = 65_536
MAX_GHOST_ENTRIES = 16_777_216  # ~4 GiB at most: a bound on the flag, not a suggestion
# OpenAI's `prompt_cache_retention`: how long a block may stay on disk; None = never written there.
RETENTION_SECONDS: dict[str, float | None] = {"in_memory": None, "24h": 24 * 3600.0}
# How the KV cache stores K/V (model/quant/kv_cache.py): "auto" the model's dtype, "bf16" the same
# for a bf16 model, "int8" and "fp8_e4m3" 8-bit codes with an fp32 scale per token and KV head.
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3")
# How the weights are held (model/quant/weights.py): "auto" keeps a GGUF file's Q8_0 weights
# 8-bit and loads the rest in the model's dtype; "none" loads every weight in the model's dtype;
# "int8" also quantizes every other linear per channel (symmetric, cached on disk).
QUANTIZATIONS = ("auto", "none", "int8")


def _invalid(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_optional_count(name: str, value: object) -> None:
    """None or an int >= 0 (a count of blocks)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise _invalid(name, value, "None or an integer >= 0")


def _check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(name, value, "a positive integer" + (" or None" if allow_none else ""))


@dataclass(slots=True)
class CacheConfig:
    """The KV-cache pool and the prefix cache over it.

    `num_kv_blocks` is the number of allocatable blocks (the null block comes on top); when None
    the pool is sized from `kv_cache_memory_gb` (or a default budget) by the engine.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_kv_events: bool = False
    # Most blocks operators may pin (None: a quarter of the pool).
    max_pinned_blocks: int | None = None
    # Most blocks clients' cache breakpoints may hold (core/kv_cache/breakpoints.py), in all and
    # per tenant (None: half and a quarter of the pool).
    max_breakpoint_blocks: int | None = None
    max_breakpoint_blocks_per_tenant: int | None = None
    # The eviction policy (the free queue's order): "lru", "slru" or "cost" (kv_cache/eviction/).
    eviction_policy: str = "lru"
    # Evicted block hashes remembered so cache reports can say `evicted` (0: none remembered).
    cache_ghost_entries: int = DEFAULT_GHOST_ENTRIES
    # How K/V are stored (KV_CACHE_DTYPES): 8-bit formats hold ~1.9x the tokens in the same bytes.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        if (
            isinstance(self.cache_ghost_entries, bool)
            or not isinstance(self.cache_ghost_entries, int)
            or not 0 <= self.cache_ghost_entries <= MAX_GHOST_ENTRIES
        ):
            raise _invalid(
                "cache_ghost_entries",
                self.cache_ghost_entries,
                f"an integer in [0, {MAX_GHOST_ENTRIES}]",
            )
        for name in (
            "max_pinned_blocks",
            "max_breakpoint_blocks",
            "max_breakpoint_blocks_per_tenant",
        ):
            _check_optional_count(name, getattr(self, name))
        if self.block_size > 1024:
            raise _invalid("block_size", self.block_size, "at most 1024")
        _check_positive_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.kv_cache_memory_gb is not None:
            if (
                isinstance(self.kv_cache_memory_gb, bool)
                or not isinstance(self.kv_cache_memory_gb, int | float)
                or not self.kv_cache_memory_gb > 0
            ):
                raise _invalid("kv_cache_memory_gb", self.kv_cache_memory_gb, "a number > 0")
            if self.num_kv_blocks is not None:
                raise ValueError(
                    "give num_kv_blocks or kv_cache_memory_gb, not both "
                    f"(got num_kv_blocks={self.num_kv_blocks!r}, "
                    f"kv_cache_memory_gb={self.kv_cache_memory_gb!r})"
                )
        for name in ("prefix_caching_hash_algo", "eviction_policy"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _invalid(name, getattr(self, name), "a name")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _invalid("kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
        for name in ("enable_prefix_caching", "enable_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, getattr(self, name), "True or False")


SCHEDULING_POLICIES = ("fair", "fcfs")
ADMISSION_ORDERS = ("fcfs", "longest_prefix")


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step budgets of the scheduler.

    `max_num_batched_tokens` bounds the tokens computed in one step (prefill chunks plus decode
    tokens); `max_num_seqs` bounds the running requests; `long_prefill_token_threshold` (0 = off)
    caps the chunk one request gets in a step so long prompts do not starve the others.
    `scheduling_policy` "fair" shares steps, the waiting queue and preemptions between tenants
    (`fair_share.py`); "fcfs" is vLLM's first come, first served over all tenants together. With
    one tenant the two plan the same steps. `fair_chunk_tokens` (0 = off) caps one request's
    prefill chunk while several tenants share a step (policy "fair" only): a step's time grows
    with its tokens, and every tenant with work waits for it.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fair"
    fair_chunk_tokens: int = 512
    # "fcfs": each tenant's requests in arrival order; "longest_prefix": the longest cached
    # prefix among its first waiting requests first, with aging (prefix_order.py).
    admission_order: str = "fcfs"

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if (
            isinstance(self.long_prefill_token_threshold, bool)
            or not isinstance(self.long_prefill_token_threshold, int)
            or self.long_prefill_token_threshold < 0
        ):
            raise _invalid(
                "long_prefill_token_threshold",
                self.long_prefill_token_threshold,
                "an integer >= 0 (0 disables it)",
            )
        if (
            isinstance(self.fair_chunk_tokens, bool)
            or not isinstance(self.fair_chunk_tokens, int)
            or self.fair_chunk_tokens < 0
        ):
            raise _invalid("fair_chunk_tokens", self.fair_chunk_tokens, "an integer >= 0 (0: off)")
        if self.admission_order not in ADMISSION_ORDERS:
            raise _invalid("admission_order", self.admission_order, f"one of {ADMISSION_ORDERS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise _invalid(
                "scheduling_policy", self.scheduling_policy, f"one of {SCHEDULING_POLICIES}"
            )


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """The disk tier's settings, validated on construction.

    `dir` None is `settings.kv_store_root()` and `capacity_bytes` None is
    `default_capacity_bytes`, both filled in by `kv_store.resolve_store_config`.
    `default_retention` applies to requests that ask for none ("in_memory": never written to
    disk; "24h": kept up to 24 hours).
    The writer queue bounds how much K/V waits in memory for the disk.
    """

    dir: Path | None = None
    capacity_bytes: int | None = None
    enabled: bool = True
    default_retention: str = "24h"
    writer_queue_bytes: int = 256 << 20
    writer_queue_items: int = 4096
    # The tier shared across hosts (kv_store/remote/): a redis://, rediss:// or unix:// URL, and
    # the file holding its password (never the URL itself); None: no shared tier. Its values are
    # MACed with the key in `remote_key_file` (kv_store/tier_key.py), required with a URL.
    remote_url: str | None = None
    remote_password_file: Path | None = None
    remote_key_file: Path | None = None
    # The disk tier's own key (a directory other hosts write, under the same user id, on a network
    # filesystem): its records MACed, its hash seed
    # derived from the key rather than read from the directory; None: checksums and the seed file.
    key_file: Path | None = None
    # Reads of a waiting request's blocks on their own thread while others compute
    # (kv_store/loads.py); False: at admission, on the step thread.
    overlap_loads: bool = True

    def __post_init__(self) -> None:
        if self.remote_url is not None and (
            not isinstance(self.remote_url, str) or not self.remote_url
        ):
            raise ValueError(f"kv remote url must be a URL, got {self.remote_url!r}")
        if self.remote_url is not None and self.remote_key_file is None:
            raise ValueError(
                "--kv-remote needs --kv-remote-key-file (kv_remote_key_file): the file holding "
                "the key the hosts share, which authenticates every value on the server and "
                "never goes to it (docs/shared-tier.md)"
            )
        for name in ("remote_password_file", "remote_key_file", "key_file"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)).expanduser())
        if self.dir is not None:
            if not isinstance(self.dir, str | Path) or not str(self.dir):
                raise ValueError(f"kv store dir must be a path, got {self.dir!r}")
            object.__setattr__(self, "dir", Path(self.dir).expanduser())
        if not isinstance(self.enabled, bool):
            raise ValueError(f"kv store enabled must be True or False, got {self.enabled!r}")
        if self.default_retention not in RETENTION_SECONDS:
            valid = ", ".join(repr(r) for r in RETENTION_SECONDS)
            raise ValueError(
                f"unknown prompt cache retention {self.default_retention!r}; valid: {valid}"
            )
        for name in ("capacity_bytes", "writer_queue_bytes", "writer_queue_items"):
            value = getattr(self, name)
            if value is None and name == "capacity_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"kv store {name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """`max_loras`: adapters loaded at once (each keeps its low-rank weights in memory; a step
    batches requests of all of them with the base model's). `max_lora_rank`: the largest rank
    accepted (vLLM's default is 16)."""

    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be at most 512, got {self.max_lora_rank}")


METHODS = ("ngram",)
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
# The most drafts one request may propose a step: each is a row of the verification pass.
MAX_SPECULATIVE_TOKENS = 32
# The longest n-gram the proposer looks up (each token indexes one entry per n-gram length).
MAX_PROMPT_LOOKUP = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """N-gram speculation ("prompt lookup decoding"), with vLLM's field names and defaults.

    Each decode step a request proposes up to `num_speculative_tokens` drafts: the tokens that
    followed the latest earlier occurrence of its last n tokens, for the largest n in
    [`prompt_lookup_min`, `prompt_lookup_max`] that occurs. Unset bounds follow vLLM: both
    unset are 5 and 5; one unset takes the other's value.

    `hold_for_prefill` (prefixserve's own; vLLM drafts in every step): no drafts in a step that
    carries a chunk of several tokens (`Scheduler._prefill_pending`: a prompt, tokens a grammar
    forced, or a waiting request that can start now), so a new turn's first token does not wait
    for the verification rows of every decoding request.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    hold_for_prefill: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if not isinstance(self.hold_for_prefill, bool):
            raise ValueError(
                f"speculative_config hold_for_prefill must be true or false, "
                f"got {self.hold_for_prefill!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_int("prompt_lookup_min", lo, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", hi, MAX_PROMPT_LOOKUP)
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) must be at most "
                f"prompt_lookup_max ({hi})"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)


def _check_int(name: str, value: object, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValueError(
            f"speculative_config {name} must be an integer in [1, {most}], got {value!r}"
        )


def speculative_config_from(
    value: SpeculativeConfig | dict[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """A SpeculativeConfig from what a user gives (`LLM(speculative_config=...)`, the server's
    `--speculative-config` JSON); None stays None (speculation off). A ValueError names an
    unknown key, a bad value or malformed JSON."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    for required in ("method", "num_speculative_tokens"):
        if required not in value:
            raise ValueError(f"speculative_config needs {required} (e.g. {_EXAMPLE})")
    return SpeculativeConfig(**value)


@dataclass(slots=True)
class StructuredOutputsConfig:
    """Structured outputs (structured_output/): the grammar compile's bounds and jump-forward."""

    # A request waits at most this long for its grammar's compile; past it, a 400.
    compile_timeout_s: float = 5.0
    # Tokens a grammar forces are appended at once and computed as one chunk (the same tokens
    # as without it, in fewer steps).
    jump_forward: bool = True
    # Compiles one tenant may have in flight (queued or running); one more is a 429.
    max_compiles_per_tenant: int = 4
    # Compiled grammars cached per tenant (least recently used first out).
    max_cached_grammars_per_tenant: int = 256
    # The constraints' text cached in all, in characters (a compiled grammar's memory is up to
    # ~75 bytes per character of its schema), least recently used first out.
    max_cached_grammar_chars: int = 16 << 20

    def __post_init__(self) -> None:
        timeout = self.compile_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= 600
        ):
            raise _invalid("structured_outputs_compile_timeout", timeout, "a number in (0, 600]")
        if not isinstance(self.jump_forward, bool):
            raise _invalid("structured_outputs_jump_forward", self.jump_forward, "a bool")
        _check_positive_int("max_grammar_compiles_per_tenant", self.max_compiles_per_tenant)
        _check_positive_int("max_cached_grammars_per_tenant", self.max_cached_grammars_per_tenant)
        _check_positive_int("max_cached_grammar_chars", self.max_cached_grammar_chars)


@dataclass(slots=True)
class EngineConfig:
    """Everything LLMEngine needs: which model, in which dtype, and the cache and scheduler.

    `model=None` is the packaged default model. `max_model_len=None` takes the model's own
    context length; a larger value than the model's is an error raised when the model is loaded.
    """

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # The prefix cache's disk tier (kv_store/); None or enabled=False: RAM pool only.
    kv_store: KVStoreConfig | None = None
    # Speculative decoding (spec_decode/): vLLM's speculative_config as a dict, its JSON or a
    # SpeculativeConfig; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (lora/): None: off (a request with a LoRARequest is refused).
    lora: LoRAConfig | None = None
    # Requests may bring prompt embeddings instead of token ids (vLLM's enable_prompt_embeds).
    enable_prompt_embeds: bool = False
    # Every row's result independent of the other rows of its step, of how its prompt was
    # chunked and of where its K/V came from (model/layers: one linear and one attention path
    # for every row count), so a cache hit gives the cold start's bf16 output bit for bit.
    # None: on wherever the runner can make it so for a bf16 model (the native kernels are
    # there), off otherwise (worker/model_runner.py `resolve_batch_invariant`).
    batch_invariant: bool | None = None
    # How the weights are held (QUANTIZATIONS).
    quantization: str = "auto"
    # Structured outputs: compile bounds, jump-forward.
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # A Jinja chat template (its text) used instead of the model's own (`--chat-template`).
    chat_template: str | None = None

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise _invalid("quantization", self.quantization, f"one of {QUANTIZATIONS}")
        if self.quantization == "int8" and self.dtype != "bfloat16":
            raise ValueError(f"quantization='int8' computes in bfloat16; got dtype={self.dtype!r}")

    def _check_chat(self) -> None:
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or not self.chat_template.strip()
        ):
            raise _invalid("chat_template", self.chat_template, "None or a Jinja template's text")
        if not isinstance(self.structured_outputs, StructuredOutputsConfig):
            raise _invalid(
                "structured_outputs", self.structured_outputs, "a StructuredOutputsConfig"
            )

    def __post_init__(self) -> None:
        self._check_quantization()
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise _invalid("model", self.model, "None (the default model) or a path")
        if self.dtype not in SUPPORTED_DTYPES:
            raise _invalid("dtype", self.dtype, f"one of {', '.join(SUPPORTED_DTYPES)}")
        _check_positive_int("max_model_len", self.max_model_len, allow_none=True)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise _invalid("max_model_len", self.max_model_len, "at least 2")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _invalid("seed", self.seed, "an integer >= 0")
        if not isinstance(self.cache, CacheConfig):
            raise _invalid("cache", self.cache, "a CacheConfig")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise _invalid("scheduler", self.scheduler, "a SchedulerConfig")
        if self.kv_store is not None and not isinstance(self.kv_store, KVStoreConfig):
            raise _invalid("kv_store", self.kv_store, "None or a KVStoreConfig")
        self.speculative_config = speculative_config_from(self.speculative_config)
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise _invalid("lora", self.lora, "None or a LoRAConfig")
        if not isinstance(self.enable_prompt_embeds, bool):
            raise _invalid("enable_prompt_embeds", self.enable_prompt_embeds, "a bool")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise _invalid("batch_invariant", self.batch_invariant, "None (auto) or a bool")
        self._check_chat()
