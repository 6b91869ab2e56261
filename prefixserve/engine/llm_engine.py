"""The step loop: requests in, one scheduled forward pass per step, RequestOutputs out.

LLMEngine owns the model runner, the KV-cache manager, the scheduler and the output processor.
`add_request` validates a prompt and turns it into one Request per sample (`n > 1` fans out into
n Requests whose prompt blocks are shared through the prefix cache); `step` schedules, runs the
model, applies the sampled tokens in the scheduler and hands the updates to the output processor
(text, stop strings, logprobs), finishing in the scheduler what a stop string ended.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

from prefixserve.config import (
    DEFAULT_KV_CACHE_MEMORY_GB,
    KV_CACHE_DTYPES,
    EngineConfig,
    SpeculativeConfig,
)
from prefixserve.core.kv_cache import hashing
from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint, request_breakpoints
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.reports.explain import CacheExplainer
from prefixserve.core.kv_cache.reports.report import CacheReport
from prefixserve.core.kv_cache.sizing import blocks_needed, size_kv_pool
from prefixserve.core.kv_cache.spec import KVCacheConfig, KVCacheSpec
from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.engine.cache_summary import build_cache_summary
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.input_checks import (
    check_fits_pool,
    check_prompt,
    check_request_fields,
    effective_max_tokens,
)
from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.inputs.prompt_embeds import prompt_from_embeds
from prefixserve.kv_store.open_tiers import open_engine_kv_store
from prefixserve.kv_store.worker import kv_layout, layout_string
from prefixserve.lora.config import LoRARequest
from prefixserve.lora.manager import LoRAManager
from prefixserve.model.kernels.calibration import describe_calibration
from prefixserve.model.loader.loading import LoadedModel, load_model
from prefixserve.model.quant.kv_cache import kv_format
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams
from prefixserve.spec_decode.ngram import NgramProposer
from prefixserve.worker.model_runner import ModelRunner


class LLMEngine:
    """A synchronous engine: `add_request`, then `step` until `has_unfinished_requests` is False.

    `loaded_model` lets callers (tests, benchmarks) reuse weights already loaded with
    `prefixserve.model.loader.loading.load_model`; it must match `config.model` and `config.dtype`.
    """

    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None) -> None:
        self.config = config
        if loaded_model is None:
            loaded_model = load_model(
                config.model,
                dtype=config.dtype,
                max_model_len=config.max_model_len,
                quantization=config.quantization,
            )
        elif loaded_model.config.dtype != config.dtype:
            raise ValueError(
                f"dtype={config.dtype!r} but the given model was loaded in "
                f"{loaded_model.config.dtype!r}"
            )
        self.loaded_model = loaded_model
        self.tokenizer = loaded_model.tokenizer
        self.model_config = loaded_model.config
        model_len = self.model_config.max_model_len
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len must be at most the model's context length {model_len}, "
                f"got {config.max_model_len}"
            )
        self.max_model_len = config.max_model_len or model_len
        self.vocab_size = self.model_config.vocab_size

        cache = config.cache
        self.block_size = cache.block_size
        self.kv_cache_groups: list[KVCacheSpec] = list(self.model_config.kv_cache_groups())
        self.num_kv_blocks = self._num_kv_blocks()
        kv_config = KVCacheConfig(
            num_blocks=self.num_kv_blocks + 1,
            block_size=cache.block_size,
            groups=self.kv_cache_groups,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.kv_cache_manager = KVCacheManager(
            kv_config,
            enable_caching=cache.enable_prefix_caching,
            enable_kv_cache_events=cache.enable_kv_events,
            max_pinned_blocks=(
                self.num_kv_blocks // 4
                if cache.max_pinned_blocks is None
                else cache.max_pinned_blocks
            ),
            eviction_policy=cache.eviction_policy,
            ghost_entries=cache.cache_ghost_entries,
            max_breakpoint_blocks=cache.max_breakpoint_blocks,
            max_breakpoint_blocks_per_tenant=cache.max_breakpoint_blocks_per_tenant,
        )
        eos_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig parsed it
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.max_model_len,
            eos_token_ids=eos_ids,
            proposer=NgramProposer(spec) if spec is not None else None,
        )
        self.runner = ModelRunner(
            loaded_model.model,
            self.model_config,
            num_blocks=self.num_kv_blocks + 1,
            block_size=cache.block_size,
            seed=config.seed,
            batch_invariant=config.batch_invariant,
            kv_cache_dtype=cache.kv_cache_dtype,
        )
        self.kv_connector, none_hash = open_engine_kv_store(
            config,
            loaded_model.path,
            self.kv_cache_groups,
            kv_layout(self.runner.kv_caches, self.runner.kv_format.name),
            self.runner.kv_numerics(),
            self._other_kv_layouts(),
        )
        if self.kv_connector is not None:
            self.scheduler.kv_connector = self.kv_connector
            # Queued writes reach the disk when the engine is collected or the process exits.
            weakref.finalize(self, self.kv_connector.close)
        self._block_hasher = get_request_block_hasher(
            cache.block_size, cache.prefix_caching_hash_algo, none_hash=none_hash
        )
        self._none_hash = none_hash
        # Every request's cache report, at its first scheduling (kv_cache/reports/).
        self.explainer = CacheExplainer(
            self.kv_cache_manager,
            self.kv_cache_manager.recorder,
            self._block_hasher,
            disk=self.kv_connector,
        )
        self.scheduler.explainer = self.explainer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            self.lora = self.runner.lora = LoRAManager(
                loaded_model.model, self.model_config, config.lora
            )

    def _max_chunk(self) -> int:
        """The most tokens one request computes in one step (a prefill or recompute chunk)."""
        sched = self.config.scheduler
        threshold = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
        return min(sched.max_num_batched_tokens, threshold)

    def _other_kv_layouts(self) -> dict[str, str]:
        """The disk layouts of this model's other KV dtypes (`kv_layout` and `kv_numerics` as an
        engine of that dtype would build them), for cache reports that name a block stored in
        another."""
        k_cache = self.runner.kv_caches[0][0]
        _, block_size, heads, _ = k_cache.shape
        head_dim, own = self.model_config.head_dim, self.runner.kv_format.name
        layouts = {}
        for name in KV_CACHE_DTYPES:
            try:
                fmt = kv_format(name, self.model_config.torch_dtype)
            except ValueError:
                continue  # not a format of this model's dtype
            if fmt.name != own:
                layouts[fmt.name] = layout_string(
                    len(self.runner.kv_caches),
                    block_size,
                    heads,
                    fmt.row_width(head_dim),
                    fmt.storage,
                    fmt.name,
                ) + self.runner.kv_numerics(fmt.name)
        return layouts

    def _blocks_needed(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of `num_tokens` cached tokens holds at once."""
        return blocks_needed(self.kv_cache_groups, num_tokens, self.block_size, self._max_chunk())

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        return size_kv_pool(
            num_kv_blocks=cache.num_kv_blocks,
            kv_cache_memory_gb=cache.kv_cache_memory_gb,
            default_memory_gb=DEFAULT_KV_CACHE_MEMORY_GB,
            bytes_per_block=self.model_config.kv_cache_bytes_per_block(
                cache.block_size, kv_format(cache.kv_cache_dtype, self.model_config.torch_dtype)
            ),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            blocks_per_request=blocks_needed(
                self.kv_cache_groups, self.max_model_len, cache.block_size, self._max_chunk()
            ),
        )

    # ----------------------------------------------------------------- requests in

    @property
    def kernel_summary(self) -> str:
        """One line: the native GEMM's tile families (the host's calibration) and whether the
        runner is batch-invariant (a cache hit gives the cold start's bits)."""
        mode = "on" if self.runner.batch_invariant else "off"
        return f"{describe_calibration()}; batch-invariant {mode}"

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt: str | None = None,
        tenant: str | None = None,
        cache_retention: str | None = None,
        lora_request: LoRARequest | None = None,
        prompt_embeds: Any = None,
        lora_read: Any = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> None:
        """Queue one prompt for `params.n` samples.

        `lora_request` runs it with that LoRA adapter (loaded on first use; the engine needs a
        `lora` config). `prompt_embeds` (a [num_tokens, hidden_size] float tensor, with
        `enable_prompt_embeds`) replaces the prompt's token ids, which must then be empty.
        `lora_read`: the adapter `LoRAManager.read` made of `lora_request` off this thread.

        `cache_retention` is OpenAI's `prompt_cache_retention`: "in_memory" (its blocks are
        never written to the disk tier) or "24h" (kept there up to 24 hours); None is the
        store's default.

        `tenant` names who the request is for: the scheduler shares each step and the waiting
        queue fairly between tenants (`fair_share.py`). It is not a cache key (`cache_salt` is),
        but it owns the request's `cache_breakpoints` (`core/kv_cache/breakpoints.py`: prompt
        prefixes held for a time-to-live within the tenant's budget). A "24h" retention
        without breakpoints holds the whole prompt's full blocks for 24 hours.

        Raises ValueError (naming the field) for a duplicate request_id, an empty prompt, token
        ids outside the vocabulary, a prompt or max_tokens past max_model_len, or a request too
        long for the KV pool.
        """
        check_request_fields(request_id, params, cache_salt, cache_retention)
        embeds_bits_ = None
        if prompt_embeds is not None:
            if not self.config.enable_prompt_embeds:
                raise ValueError(
                    "prompt_embeds are not enabled: build the engine with "
                    "enable_prompt_embeds=True (--enable-prompt-embeds)"
                )
            prompt_token_ids, embeds_bits_ = prompt_from_embeds(
                prompt_token_ids, prompt_embeds, params, self.model_config, self.max_model_len
            )
        prompt_token_ids = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        num_prompt = len(prompt_token_ids)
        cache_breakpoints = request_breakpoints(cache_breakpoints, cache_retention, num_prompt)
        max_tokens = effective_max_tokens(params, num_prompt, self.max_model_len)
        # The last sampled token never gets K/V, so the longest sequence caches this many tokens.
        needed = self._blocks_needed(num_prompt + max_tokens - 1)
        check_fits_pool(needed, num_prompt, max_tokens, self.num_kv_blocks)
        lora_name = lora_digest = None  # the adapter is loaded only for a request that fits
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(
                    "this engine serves no LoRA adapters: build it with enable_lora=True"
                )
            adapter = self.lora.resolve(lora_request, self.lora_in_use, lora_read)
            lora_name, lora_digest = adapter.name, adapter.digest

        requests = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                # Only sample 0's prompt logprobs are reported: the others neither compute them
                # nor skip the prefix cache for them.
                prompt_logprobs = params.prompt_logprobs if index == 0 else None
                child_params = dataclasses.replace(
                    params, n=1, seed=seed, prompt_logprobs=prompt_logprobs
                )
            requests.append(
                Request(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    block_hasher=self._block_hasher,
                    cache_salt=cache_salt,
                    max_tokens=max_tokens,
                    tenant=tenant,
                    cache_retention=cache_retention,
                    lora_name=lora_name,
                    lora_digest=lora_digest,
                    prompt_embeds=embeds_bits_,
                    cache_breakpoints=cache_breakpoints,
                )
            )
        for request in requests[1:]:
            request.counted_in_reports = False  # a prompt's samples are one request to count
        manager = self.kv_cache_manager  # pinned blocks are not the request's to take
        available = manager.blocks_available_to(requests[0])
        check_fits_pool(needed, num_prompt, max_tokens, available, manager.num_held_blocks)
        self.output_processor.add_prompt(request_id, prompt, prompt_token_ids, params, requests)
        for request in requests:
            self.scheduler.add_request(request)

    # ----------------------------------------------------------------- LoRA adapters

    def add(self, request: EngineRequest, lora_read: Any = None) -> None:
        """`add_request` for an `EngineRequest` (what engine clients pass around); its routing
        fields (`prompt_cache_key`, `final_only`) mean nothing to one engine."""
        self.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            cache_salt=request.cache_salt,
            prompt=request.prompt,
            tenant=request.tenant,
            cache_retention=request.cache_retention,
            lora_request=request.lora_request,
            prompt_embeds=request.prompt_embeds,
            lora_read=lora_read,
            cache_breakpoints=request.cache_breakpoints,
        )

    def lora_in_use(self, name: str) -> int:
        """Unfinished requests that run with the LoRA adapter `name`."""
        return sum(1 for r in self.scheduler.requests.values() if r.lora_name == name)

    def load_lora_adapter(self, name: str, path: str, read: Any = None) -> None:
        """Load a PEFT adapter as `name` (ValueError for anything that does not fit); `read`:
        what `LoRAManager.read` made of it already."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: build it with enable_lora=True")
        self.lora.load(name, path, self.lora_in_use, read)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name`: KeyError when it is not loaded, LoRAInUseError (a ValueError) while
        unfinished requests use it. Its cached blocks stay until evicted; only the same files
        loaded again under the same name hit them (their hashes carry its name and digest)."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.unload(name, self.lora_in_use)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort prompts (all their samples) by request_id; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            for child_id in self.output_processor.remove_prompt(request_id):
                self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_ABORTED)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """With nothing left to schedule there is no next forward pass to drop the runner's
        state of finished requests (seeded generators): drop it now."""
        if not self.scheduler.has_unfinished_requests() and self.scheduler.finished_req_ids:
            self.runner.release(self.scheduler.finished_req_ids)
            self.scheduler.finished_req_ids = set()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return the outputs of prompts that got new tokens
        (cumulative text and token ids; `finished` set on a prompt's last output)."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.scheduled:
            started = time.perf_counter()
            try:
                runner_output = self.runner.execute(scheduler_output)
            except BaseException:
                self._discard_failed_step(scheduler_output)
                raise
            compute_s = time.perf_counter() - started
        else:
            self.runner.release(scheduler_output.finished_req_ids)  # no forward pass to take them
            runner_output = ModelRunnerOutput(failed=self._stuck_request_error())
        failed_outputs: list[RequestOutput] = []
        if runner_output.failed:
            failed_outputs = self._fail_requests(scheduler_output, runner_output.failed)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.kv_connector is not None and scheduler_output.scheduled:
            # After the update: blocks that accepted drafts completed have their hashes now.
            self._save_to_store(scheduler_output, runner_output, compute_s)
        processed = self.output_processor.process_updates(updates)
        for child_id, stop_string in processed.stopped:
            self.scheduler.finish_requests(
                child_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop_string
            )
        if processed.failed:
            self.scheduler.finish_requests(processed.failed, RequestStatus.FINISHED_ABORTED)
        self._release_if_idle()
        if failed_outputs:
            return failed_outputs + processed.outputs
        return processed.outputs

    def _fail_requests(
        self, scheduler_output: SchedulerOutput, errors: dict[str, str]
    ) -> list[RequestOutput]:
        """Requests the runner could not sample (the pass itself worked): uncache the blocks
        they filled this step (their K/V may be what made the logits non-finite), then finish
        their prompts with the error; everyone else in the step goes on."""
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if request.request_id in errors:
                self.kv_cache_manager.uncache_uncomputed_blocks(
                    request, scheduled.num_computed_tokens
                )
        outputs, child_ids = self.output_processor.fail_samples(errors)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return outputs

    def _discard_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """After a forward pass failed: its blocks were cached when allocated but their K/V may
        never have been written, so forget their hashes, then abort every prompt it scheduled
        (same-step hitters of those blocks included: they were scheduled too)."""
        manager = self.kv_cache_manager
        manager.uncache_block_ids(block_id for block_id, _ in scheduler_output.kv_loads)
        prompt_ids = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            manager.uncache_uncomputed_blocks(request, scheduled.num_computed_tokens)
            prompt_id = self.output_processor.prompt_of(request.request_id)
            if prompt_id is not None:
                prompt_ids.append(prompt_id)
        self.abort_request(dict.fromkeys(prompt_ids))

    def _stuck_request_error(self) -> dict[str, str]:
        """After a step that scheduled nothing: the waiting head could not get its blocks with
        nothing running, so it never will (admission makes this rare: pins made after it was
        queued). It fails alone; the engine goes on."""
        stuck = self.scheduler.stuck_request()
        if stuck is None:
            return {}
        pinned = self.kv_cache_manager.num_held_blocks
        return {
            stuck.request_id: f"the request ({stuck.num_tokens} tokens) cannot get its KV blocks "
            f"from an idle pool of {self.num_kv_blocks} blocks, {pinned} of them pinned"
        }

    def _save_to_store(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, compute_s: float
    ) -> None:
        """Write-through to the disk tier: copy out the blocks this step completed (before the
        next step may reuse them; blocks of requests the update just finished are free but not
        reused before the next schedule) and queue them on the store's writer. `compute_s`: the
        forward pass's seconds, reported with the step's tokens less its drafts."""
        assert self.kv_connector is not None
        self.kv_connector.record_compute(
            compute_s, sum(s.num_new_tokens for s in scheduler_output.scheduled)
        )
        saves = self.kv_connector.blocks_to_save(scheduler_output, runner_output.failed)
        if saves:
            payloads = self.runner.gather_blocks([save.block_id for save in saves])
            self.kv_connector.save(saves, payloads)

    def close(self) -> None:
        """Release this engine's pins on the tiers, write what the disk tier's writer holds,
        then stop it (idempotent)."""
        if self.kv_connector is not None:
            self.kv_connector.close()

    # ----------------------------------------------------------------- cache and metrics

    def get_metrics(self) -> dict[str, Any]:
        """Counters since the engine started, plus the current pool and queue state (how
        replicas' combine: `engine/metrics.py`)."""
        cache = self.kv_cache_manager.make_prefix_cache_stats()
        sched = self.scheduler.stats
        return {
            # Fresh admissions only (vLLM's prefix_cache_* counters); re-admissions after a
            # preemption are counted apart.
            "prefix_cache_requests": cache.requests,
            "prefix_cache_queries": cache.queries,
            "prefix_cache_hits": cache.hits,
            "prefix_cache_hit_rate": cache.hit_rate,
            "prefix_cache_preempted_requests": cache.preempted_requests,
            "prefix_cache_preempted_queries": cache.preempted_queries,
            "prefix_cache_preempted_hits": cache.preempted_hits,
            "kv_cache_usage": self.kv_cache_manager.usage,
            **self.kv_cache_format(),
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_kv_blocks": self.kv_cache_manager.num_free_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "prompt_tokens": sched.num_prompt_tokens,
            "computed_prompt_tokens": sched.num_computed_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "num_preemptions": sched.num_preemptions,
            "num_finished_requests": sched.num_finished_requests,
            "spec_decode_num_drafts": sched.spec_decode_num_drafts,
            "spec_decode_num_draft_tokens": sched.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens": sched.spec_decode_num_accepted_tokens,
            **sched.spec_decode_rates(),
            **(self.kv_connector.metrics() if self.kv_connector is not None else {}),
            **self._cache_report_metrics(),
        }

    def kv_cache_format(self) -> dict[str, Any]:
        """How the pool stores K/V: `kv_cache_dtype` (bf16, float32, int8, fp8_e4m3) and
        `kv_cache_bytes_per_token` (every layer's K and V rows of one token, 8-bit scales
        included)."""
        fmt, config = self.runner.kv_format, self.model_config
        per_token = 2 * config.num_layers * config.num_kv_heads * fmt.row_bytes(config.head_dim)
        return {"kv_cache_dtype": fmt.name, "kv_cache_bytes_per_token": per_token}

    def _cache_report_metrics(self) -> dict[str, int]:
        """Requests by the reason of their first missed block (`cache_miss_<reason>`), and the
        pool's cached, pinned and remembered-evicted block counts."""
        manager = self.kv_cache_manager
        return {
            **{f"cache_miss_{reason}": n for reason, n in self.explainer.counts.items()},
            "kv_cache_cached_blocks": len(manager.block_pool.cached_block_hash_to_block[0]),
            "kv_cache_pinned_blocks": manager.pins.num_blocks,
            "kv_cache_breakpoint_blocks": manager.breakpoints.num_blocks,
            "kv_cache_breakpoints": len(manager.breakpoints),
            "prefix_cache_write_tokens": self.scheduler.stats.num_cache_write_tokens,
            "cache_ghost_entries": len(manager.recorder.ghosts),
        }

    def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        """The cache-wide summary operators read (`engine/cache_summary.py`); prefix text only
        with `include_text`. `build_s`: the seconds building it took (on the step thread)."""
        start = time.perf_counter()
        decode = self.tokenizer.decode if include_text else None
        fmt = self.kv_cache_format()
        kv_cache = {
            "dtype": fmt["kv_cache_dtype"],
            "bytes_per_token": fmt["kv_cache_bytes_per_token"],
        }
        summary = build_cache_summary(
            self.kv_cache_manager, self.explainer, self.kv_connector, decode, kv_cache
        )
        summary["breakpoints"] = self.describe_breakpoints()
        # Its own time, for the callers that space rebuilds by it (serving_cache.SummaryFeed).
        summary["build_s"] = time.perf_counter() - start
        return summary

    def describe_breakpoints(self) -> dict[str, Any]:
        """Clients' held breakpoints: per tenant {"breakpoints", "blocks", "tokens"}, the blocks
        held in all, the bounds, and the prompt tokens written at breakpoints so far."""
        held = self.kv_cache_manager.breakpoints
        return {
            "tenants": held.describe(),
            "held_blocks": held.num_blocks,
            "capacity_blocks": held.capacity_blocks,
            "tenant_budget_blocks": held.tenant_budget_blocks,
            "write_tokens": self.scheduler.stats.num_cache_write_tokens,
        }

    def explain_prompt(
        self,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> CacheReport:
        """The cache report this prompt would get now, without running it: what it would hit,
        and why its first missed block would miss (with, when a cached sibling shares some of
        its tokens, the first position where they part). Nothing is scheduled or counted."""
        check_request_fields("explain", SamplingParams(), cache_salt, None)
        ids = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        lora_name = lora_digest = None
        if lora_request is not None:
            adapter = self.lora.adapters.get(lora_request.lora_name) if self.lora else None
            if adapter is None:  # nothing loaded, nothing changed: no block of it is cached
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r} is not loaded: load it (or run a "
                    "request with it) first"
                )
            lora_name, lora_digest = adapter.name, adapter.digest
        probe = Request(
            f"explain-{uuid.uuid4().hex}",  # never a real request id
            ids,
            SamplingParams(),
            block_hasher=self._block_hasher,
            cache_salt=cache_salt,
            tenant=tenant,
            lora_name=lora_name,
            lora_digest=lora_digest,
        )
        return self.explainer.explain_prompt(probe)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool:
        """Forget all cached blocks, in the RAM pool and (unless `ram_only`) in the disk tier,
        whose namespace for this model is cleared for every process sharing the store. Returns
        False (and changes nothing) while requests hold blocks, unless `reset_running_requests`
        preempts them first (they recompute later)."""
        if not self.scheduler.reset_prefix_cache(reset_running_requests):
            return False
        if self.kv_connector is not None and not ram_only:
            self.kv_connector.clear()
        if self.kv_connector is not None:
            self.kv_connector.release_pins()  # the reset dropped every pin
        return True

    def pin_prefix(
        self, pin_id: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> int:
        """Keep the cached blocks of this prompt (under `cache_salt`) resident in the pool until
        `unpin_prefix`; returns the tokens pinned. Run the prompt first so it is cached.
        ValueError for bad input, nothing cached, a used id or a full pinned capacity."""
        check_request_fields(pin_id, SamplingParams(), cache_salt, None)
        ids = check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        probe = Request(
            pin_id, ids, SamplingParams(), block_hasher=self._block_hasher, cache_salt=cache_salt
        )
        num_tokens = self.kv_cache_manager.pin_prefix(pin_id, probe)
        unfit = self._first_unfit_request()
        if unfit is not None:
            self.unpin_prefix(pin_id)
            raise ValueError(
                f"pinning {pin_id!r} would leave queued request {unfit!r} unable to ever get "
                "its KV blocks; pin it when that request has finished"
            )
        if self.kv_connector is not None:  # the tiers below RAM keep its blocks too
            self.kv_connector.pin(pin_id, probe, num_tokens)
        return num_tokens

    def _first_unfit_request(self) -> str | None:
        """The id of an unfinished request that needs more blocks than it can hold with the
        current pins (see `check_fits_pool`), or None."""
        manager = self.kv_cache_manager
        for request in self.scheduler.requests.values():
            needed = self._blocks_needed(request.num_prompt_tokens + request.max_tokens - 1)
            if needed > manager.blocks_available_to(request):
                return request.request_id
        return None

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin (its blocks stay cached, evictable again; on the tiers below RAM they
        expire a retention (24 h) from now); False when there is none."""
        if self.kv_connector is not None:
            self.kv_connector.release_pins(pin_id)
        return self.kv_cache_manager.pins.unpin(pin_id)

    def describe_pins(self) -> dict[str, Any]:
        """{"pins": {id: {"num_tokens", "num_blocks"}}, "pinned_blocks", "capacity_blocks"}."""
        pins = self.kv_cache_manager.pins
        return {
            "pins": pins.describe(),
            "pinned_blocks": pins.num_blocks,
            "capacity_blocks": pins.capacity_blocks,
        }

    @property
    def none_hash(self) -> bytes:
        """The seed of this engine's hash chains: its disk store's, else the process's."""
        return self._none_hash if self._none_hash is not None else hashing.NONE_HASH

    def take_kv_events(self) -> list:
        """KV-cache events since the last call (empty unless enable_kv_events was set)."""
        if not self.config.cache.enable_kv_events:
            return []
        return self.kv_cache_manager.take_events()

    def check_no_leaks(self) -> None:
        """Raise AssertionError naming what leaked: a request still queued or known to the
        KV-cache manager, a block not back in the free pool, or a tier read still held."""
        unfinished = self.output_processor.prompt_ids()
        assert not unfinished, f"prompts still in the engine: {unfinished}"
        assert not self.scheduler.requests, (
            f"requests still in the scheduler: {sorted(self.scheduler.requests)}"
        )
        if self.kv_connector is not None:
            held = self.kv_connector.held_loads()
            assert not held, f"tier reads still held: {held}"
        self.kv_cache_manager.check_no_leaks()
