"""The step loop: requests in, one scheduled forward pass per step, RequestOutputs out.

LLMEngine holds the parts `builder.py` builds (the model runner, the KV-cache manager, the
scheduler, the tiers below RAM), the input processor (`input_processor.py`: a request checked and
turned into one Request per sample), the output processor and the operator's controls
(`operator_controls.py`). `step` schedules, runs the model, applies the sampled tokens in the
scheduler and hands the updates to the output processor (text, stop strings, logprobs),
finishing in the scheduler what a stop string ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.core.kv_cache import hashing
from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint
from prefixserve.core.kv_cache.reports.report import CacheReport
from prefixserve.core.request import RequestStatus
from prefixserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from prefixserve.engine.builder import build_engine_parts, close_with
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.input_processor import InputProcessor
from prefixserve.engine.operator_controls import OperatorControls
from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.lora.config import LoRARequest
from prefixserve.model.kernels.calibration import describe_calibration
from prefixserve.model.loader.loading import LoadedModel
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams


class LLMEngine:
    """A synchronous engine: `add_request`, then `step` until `has_unfinished_requests` is False.

    `loaded_model` lets callers (tests, benchmarks) reuse weights already loaded with
    `prefixserve.model.loader.loading.load_model`; it must match `config.model` and `config.dtype`.
    """

    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None) -> None:
        self.config = config
        self.parts = parts = build_engine_parts(config, loaded_model)
        self.loaded_model = parts.loaded_model
        self.tokenizer = parts.loaded_model.tokenizer.with_chat_template(config.chat_template)
        self.model_config = parts.loaded_model.config
        self.max_model_len = parts.max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.block_size = config.cache.block_size
        self.kv_cache_groups = parts.kv_cache_groups
        self.num_kv_blocks = parts.num_kv_blocks
        self.kv_cache_manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.kv_connector = parts.kv_connector
        self.explainer = parts.explainer
        self.lora = parts.lora
        self.structured_outputs = parts.structured_outputs
        close_with(self, self.kv_connector)
        self.processor = InputProcessor(config, parts)
        self.output_processor = OutputProcessor(self.tokenizer)
        fmt = self.kv_cache_format()
        self.controls = OperatorControls(
            parts,
            self.processor,
            self.tokenizer.decode,
            {"dtype": fmt["kv_cache_dtype"], "bytes_per_token": fmt["kv_cache_bytes_per_token"]},
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
        self.add(
            EngineRequest(
                request_id,
                prompt_token_ids,
                params,
                cache_salt=cache_salt,
                prompt=prompt,
                tenant=tenant,
                cache_retention=cache_retention,
                lora_request=lora_request,
                prompt_embeds=prompt_embeds,
                cache_breakpoints=cache_breakpoints,
            ),
            lora_read,
        )

    def add(
        self, request: EngineRequest, lora_read: Any = None, grammar: Future | None = None
    ) -> None:
        """Queue an `EngineRequest` (what engine clients pass around; its routing fields,
        `prompt_cache_key` and `final_only`, mean nothing to one engine): its samples checked
        and made by the input processor, given their grammar (`grammar`: the compile
        `StructuredOutputManager.ahead` returned, else started here; a grammar known to be bad
        raises its GrammarError, a ValueError; a tenant past its compiles in flight raises
        GrammarBusy), then handed to the output processor and the scheduler."""
        prompt_ids, requests = self.processor.requests_for(request, self.lora_in_use, lora_read)
        for sample in requests:
            self.structured_outputs.attach(sample, grammar)
        self.output_processor.add_prompt(
            request.request_id, request.prompt, prompt_ids, request.params, requests
        )
        for sample in requests:
            self.scheduler.add_request(sample)

    # ----------------------------------------------------------------- LoRA adapters

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
                scheduler_output.grammar = self.structured_outputs.start_step(scheduler_output)
                runner_output = self.runner.execute(scheduler_output)
            except BaseException:
                self._discard_failed_step(scheduler_output)
                raise
            finally:
                if scheduler_output.grammar is not None:
                    scheduler_output.grammar.wait()  # the matchers are the scheduler's again
            compute_s = time.perf_counter() - started
        else:
            self.runner.release(scheduler_output.finished_req_ids)  # no forward pass to take them
            runner_output = ModelRunnerOutput(failed=self._stuck_request_error())
        failed_outputs: list[RequestOutput] = []
        runner_output.failed.update(self._take_grammar_failures())
        if runner_output.failed:
            failed_outputs = self._fail_requests(scheduler_output, runner_output.failed)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.scheduler.grammar_failures:  # a token its grammar refused (never expected)
            failed_outputs += self._fail_requests(scheduler_output, self._take_grammar_failures())
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

    def _take_grammar_failures(self) -> dict[str, str]:
        failures, self.scheduler.grammar_failures = self.scheduler.grammar_failures, {}
        return failures

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
        pinned = self.kv_cache_manager.held.num_blocks
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
        self.structured_outputs.close()

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
            **self.structured_outputs.metrics(),
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
            "kv_cache_pinned_blocks": manager.held.pins.num_blocks,
            "kv_cache_breakpoint_blocks": manager.held.breakpoints.num_blocks,
            "kv_cache_breakpoints": len(manager.held.breakpoints),
            "prefix_cache_write_tokens": self.scheduler.stats.num_cache_write_tokens,
            "cache_ghost_entries": len(manager.recorder.ghosts),
        }

    # ----------------------------------------------------------------- operator controls

    def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        """`OperatorControls.cache_summary`."""
        return self.controls.cache_summary(include_text)

    def describe_breakpoints(self) -> dict[str, Any]:
        """`OperatorControls.describe_breakpoints`."""
        return self.controls.describe_breakpoints()

    def explain_prompt(
        self,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> CacheReport:
        """`OperatorControls.explain_prompt`: this prompt's cache report, without running it."""
        return self.controls.explain_prompt(prompt_token_ids, cache_salt, lora_request, tenant)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool:
        """`OperatorControls.reset_prefix_cache`."""
        return self.controls.reset_prefix_cache(reset_running_requests, ram_only)

    def pin_prefix(
        self, pin_id: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> int:
        """`OperatorControls.pin_prefix`: the tokens pinned."""
        return self.controls.pin_prefix(pin_id, prompt_token_ids, cache_salt)

    def unpin_prefix(self, pin_id: str) -> bool:
        """`OperatorControls.unpin_prefix`."""
        return self.controls.unpin_prefix(pin_id)

    def describe_pins(self) -> dict[str, Any]:
        """`OperatorControls.describe_pins`."""
        return self.controls.describe_pins()

    @property
    def none_hash(self) -> bytes:
        """The seed of this engine's hash chains: its disk store's, else the process's."""
        none_hash = self.parts.none_hash
        return none_hash if none_hash is not None else hashing.NONE_HASH

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
