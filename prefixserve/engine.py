"""The step loop: requests in, one scheduled forward pass per step, RequestOutputs out.

LLMEngine owns the model runner, the KV-cache manager and the scheduler. `add_request` turns a
prompt into one Request per sample (`n > 1` fans out into n Requests whose prompt blocks are
shared through the prefix cache); `step` schedules, runs the model, applies the sampled tokens,
detokenizes them, applies stop strings and returns the outputs of the requests that moved.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.batch import ModelRunnerOutput, PositionLogprobs, SchedulerOutput
from prefixserve.config import DEFAULT_KV_CACHE_MEMORY_GB, EngineConfig
from prefixserve.kv_cache.hashing import get_request_block_hasher
from prefixserve.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.kv_cache.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from prefixserve.model.loader import LoadedModel, load_model
from prefixserve.model.tokenizer import IncrementalDetokenizer
from prefixserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from prefixserve.request import Request, RequestStatus
from prefixserve.runner import ModelRunner
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import RequestUpdate, Scheduler

_GIB = 1 << 30


@dataclass(slots=True)
class _Sample:
    """One of a prompt's n samples: its Request and what the caller sees of it."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    stop_buffer: int  # chars held back while a stop string could still be forming
    text: str = ""
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Prompt:
    """One add_request call: a prompt and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


def _blocks_needed(
    groups: list[KVCacheSpec], num_tokens: int, block_size: int, max_chunk: int
) -> int:
    """Blocks a request holding `num_tokens` tokens of K/V may need at once, over all groups,
    when one step computes at most `max_chunk` of its tokens.

    A sliding-window group holds the window behind the chunk plus the chunk itself: blocks
    covering `sliding_window - 1 + chunk` positions, one more when they straddle a boundary.
    """
    full = math.ceil(num_tokens / block_size)
    chunk = min(max_chunk, num_tokens)
    total = 0
    for spec in groups:
        if isinstance(spec, SlidingWindowSpec):
            total += min(full, math.ceil((spec.sliding_window - 1 + chunk) / block_size) + 1)
        else:
            total += full
    return total


class LLMEngine:
    """A synchronous engine: `add_request`, then `step` until `has_unfinished_requests` is False.

    `loaded_model` lets callers (tests, benchmarks) reuse weights already loaded with
    `prefixserve.model.loader.load_model`; it must match `config.model` and `config.dtype`.
    """

    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None) -> None:
        self.config = config
        if loaded_model is None:
            loaded_model = load_model(
                config.model, dtype=config.dtype, max_model_len=config.max_model_len
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
        )
        eos_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache_manager, self.max_model_len, eos_token_ids=eos_ids
        )
        self.runner = ModelRunner(
            loaded_model.model,
            self.model_config,
            num_blocks=self.num_kv_blocks + 1,
            block_size=cache.block_size,
            seed=config.seed,
        )
        self._block_hasher = get_request_block_hasher(
            cache.block_size, cache.prefix_caching_hash_algo
        )
        self._prompts: dict[str, _Prompt] = {}
        self._sample_of: dict[str, tuple[_Prompt, _Sample]] = {}

    def _max_chunk(self) -> int:
        """The most tokens one request computes in one step (a prefill or recompute chunk)."""
        sched = self.config.scheduler
        threshold = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
        return min(sched.max_num_batched_tokens, threshold)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.model_config.kv_cache_bytes_per_block(cache.block_size)
        if cache.kv_cache_memory_gb is not None:
            num = int(cache.kv_cache_memory_gb * _GIB) // per_block
            if num < 1:
                raise ValueError(
                    f"kv_cache_memory_gb={cache.kv_cache_memory_gb} holds no KV block "
                    f"(one block takes {per_block} bytes)"
                )
            return num
        # Default: the memory budget, but no more than every running request at full length.
        budget = int(DEFAULT_KV_CACHE_MEMORY_GB * _GIB) // per_block
        useful = self.config.scheduler.max_num_seqs * _blocks_needed(
            self.kv_cache_groups, self.max_model_len, cache.block_size, self._max_chunk()
        )
        return max(1, min(budget, useful))

    # ----------------------------------------------------------------- requests in

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ) -> None:
        """Queue one prompt for `params.n` samples.

        Raises ValueError (naming the field) for a duplicate request_id, an empty prompt, token
        ids outside the vocabulary, a prompt or max_tokens past max_model_len, or a request too
        long for the KV pool.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._prompts:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        prompt_token_ids = list(prompt_token_ids)
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        for token_id in prompt_token_ids:
            if (
                isinstance(token_id, bool)
                or not isinstance(token_id, int)
                or not (0 <= token_id < self.vocab_size)
            ):
                raise ValueError(
                    f"prompt_token_ids must be integers in [0, {self.vocab_size}), got {token_id!r}"
                )
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}; "
                f"a prompt may have at most {self.max_model_len - 1} tokens"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
        elif num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} plus the prompt's {num_prompt} tokens exceeds "
                f"max_model_len={self.max_model_len}; max_tokens may be at most "
                f"{self.max_model_len - num_prompt}"
            )
        # The last sampled token never gets K/V, so the longest sequence caches this many tokens.
        needed = _blocks_needed(
            self.kv_cache_groups, num_prompt + max_tokens - 1, self.block_size, self._max_chunk()
        )
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"the request needs up to {needed} KV blocks ({num_prompt} prompt tokens + "
                f"max_tokens={max_tokens}) but the pool has {self.num_kv_blocks}; "
                "raise num_kv_blocks / kv_cache_memory_gb or lower max_tokens"
            )

        entry = _Prompt(request_id, prompt, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            entry.prompt_logprobs = [None]
        stop_buffer = max((len(s) for s in params.stop_strings), default=1) - 1
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            request = Request(
                child_id,
                prompt_token_ids,
                child_params,
                block_hasher=self._block_hasher,
                cache_salt=cache_salt,
                max_tokens=max_tokens,
            )
            sample = _Sample(
                index=index,
                request=request,
                detokenizer=self.tokenizer.incremental_detokenizer(prompt_token_ids),
                stop_buffer=stop_buffer,
                logprobs=[] if params.logprobs is not None else None,
            )
            entry.samples.append(sample)
        for sample in entry.samples:
            if sample.request.request_id in self._sample_of:
                raise ValueError(f"request_id {request_id!r} collides with a running sample id")
        self._prompts[request_id] = entry
        for sample in entry.samples:
            self._sample_of[sample.request.request_id] = (entry, sample)
            self.scheduler.add_request(sample.request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort prompts (all their samples) by request_id; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            entry = self._prompts.pop(request_id, None)
            if entry is None:
                continue
            for sample in entry.samples:
                child_id = sample.request.request_id
                self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_ABORTED)
                del self._sample_of[child_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._prompts)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return the outputs of prompts that got new tokens
        (cumulative text and token ids; `finished` set on a prompt's last output)."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.scheduled:
            try:
                runner_output = self.runner.execute(scheduler_output)
            except BaseException:
                self._discard_failed_step(scheduler_output)
                raise
        else:
            if not self.scheduler.running:
                # Nothing runs and the head of the queue still does not fit: it never will.
                head = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"request {head.request_id!r} ({head.num_tokens} tokens) cannot get KV "
                    f"blocks from an idle pool of {self.num_kv_blocks}; raise num_kv_blocks"
                )
            # Nothing fit this step; keep the ids for the runner's next batch.
            self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
            runner_output = ModelRunnerOutput()
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)

        touched: dict[str, _Prompt] = {}
        for update in updates:
            found = self._sample_of.get(update.request.request_id)
            if found is None:
                continue
            entry, sample = found
            self._apply_update(entry, sample, update)
            if update.new_token_ids or sample.finished:
                touched[entry.request_id] = entry

        outputs = []
        for entry in touched.values():
            finished = entry.finished
            outputs.append(self._make_output(entry, finished))
            if finished:
                del self._prompts[entry.request_id]
                for sample in entry.samples:
                    del self._sample_of[sample.request.request_id]
        return outputs

    def _discard_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """After a forward pass failed: its blocks were cached when allocated but their K/V may
        never have been written, so forget their hashes, then abort every prompt it scheduled
        (same-step hitters of those blocks included: they were scheduled too)."""
        prompt_ids = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            self.kv_cache_manager.uncache_uncomputed_blocks(request, scheduled.num_computed_tokens)
            found = self._sample_of.get(request.request_id)
            if found is not None:
                prompt_ids.append(found[0].request_id)
        self.abort_request(dict.fromkeys(prompt_ids))

    def _apply_update(self, entry: _Prompt, sample: _Sample, update: RequestUpdate) -> None:
        request = update.request
        if update.new_prompt_logprobs and sample.index == 0 and entry.prompt_logprobs is not None:
            self._add_prompt_logprobs(entry, update)
        if not update.new_token_ids:
            return
        if sample.logprobs is not None:
            for position in update.new_logprobs:
                sample.logprobs.append(self._logprob_dict(position))
        sample.detokenizer.add_tokens(update.new_token_ids)
        full_text = sample.detokenizer.text
        stop = self._find_stop_string(full_text, sample)
        if stop is not None:
            stop_string, cut = stop
            sample.text = full_text[:cut]
            sample.finish_reason = "stop"
            sample.stop_reason = stop_string
            if not update.finished:
                self.scheduler.finish_requests(
                    request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop_string
                )
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
            return
        sample.text = full_text
        if update.finished:
            sample.finish_reason = request.status.finish_reason
            sample.stop_reason = request.stop_reason

    @staticmethod
    def _find_stop_string(text: str, sample: _Sample) -> tuple[str, int] | None:
        """The earliest stop string in `text` that the new text completed, and where it starts
        (the output is cut there). `sample.text` is still the text before this step."""
        stops = sample.request.sampling_params.stop_strings
        best: tuple[str, int] | None = None
        for stop in stops:
            # A stop string completed now ends inside the new text, so starts at most
            # len(stop) - 1 characters before it.
            index = text.find(stop, max(0, len(sample.text) - len(stop) + 1))
            if index != -1 and (best is None or index < best[1]):
                best = (stop, index)
        return best

    def _add_prompt_logprobs(self, entry: _Prompt, update: RequestUpdate) -> None:
        assert entry.prompt_logprobs is not None
        have = len(entry.prompt_logprobs)  # positions 0 .. have-1 are filled
        for offset, position in enumerate(update.new_prompt_logprobs):
            pos = update.first_prompt_logprob_pos + offset
            if pos < have:
                continue  # recomputed after a preemption
            assert pos == have, (pos, have)
            entry.prompt_logprobs.append(self._logprob_dict(position))
            have += 1

    def _logprob_dict(self, position: PositionLogprobs) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for token_id, logprob, rank in position:
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self.tokenizer.decode([token_id]))
        return result

    def _make_output(self, entry: _Prompt, finished: bool) -> RequestOutput:
        completions = []
        for sample in entry.samples:
            text = sample.text
            if not sample.finished and sample.stop_buffer:
                # Hold back what could be the start of a stop string (it would be cut later).
                text = text[: max(0, len(text) - sample.stop_buffer)]
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=text,
                    token_ids=list(sample.request.output_token_ids),
                    logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        first = entry.samples[0].request
        return RequestOutput(
            request_id=entry.request_id,
            prompt=entry.prompt,
            prompt_token_ids=entry.prompt_token_ids,
            prompt_logprobs=list(entry.prompt_logprobs) if entry.prompt_logprobs else None,
            outputs=completions,
            num_cached_tokens=max(0, first.num_cached_tokens),
            finished=finished,
        )

    # ----------------------------------------------------------------- cache and metrics

    def get_metrics(self) -> dict[str, Any]:
        """Counters since the engine started, plus the current pool and queue state."""
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
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_kv_blocks": self.kv_cache_manager.num_free_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "prompt_tokens": sched.num_prompt_tokens,
            "computed_prompt_tokens": sched.num_computed_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "num_preemptions": sched.num_preemptions,
            "num_finished_requests": sched.num_finished_requests,
        }

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget all cached blocks. Returns False (and changes nothing) while requests hold
        blocks, unless `reset_running_requests` preempts them first (they recompute later)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def take_kv_events(self) -> list:
        """KV-cache events since the last call (empty unless enable_kv_events was set)."""
        if not self.config.cache.enable_kv_events:
            return []
        return self.kv_cache_manager.take_events()

    def check_no_leaks(self) -> None:
        """Raise AssertionError naming what leaked: a request still queued or known to the
        KV-cache manager, or a block not back in the free pool."""
        assert not self._prompts, f"prompts still in the engine: {sorted(self._prompts)}"
        assert not self.scheduler.requests, (
            f"requests still in the scheduler: {sorted(self.scheduler.requests)}"
        )
        mgr = self.kv_cache_manager
        for manager in mgr.coordinator.managers:
            assert not manager.req_to_blocks, (
                f"the KV-cache manager still holds block tables of {sorted(manager.req_to_blocks)}"
            )
        mgr.check_invariants()
        assert mgr.num_free_blocks == mgr.num_total_blocks, (
            f"{mgr.num_total_blocks - mgr.num_free_blocks} of {mgr.num_total_blocks} KV blocks "
            "are not free with no request running"
        )
