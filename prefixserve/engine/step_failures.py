"""What the engine does when a step fails: for some requests (the runner could not sample them)
or for the whole forward pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.request import RequestStatus
from prefixserve.core.sched.output import SchedulerOutput
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.outputs import RequestOutput


class StepOwner(Protocol):
    """What failure handling needs of an `LLMEngine`."""

    kv_cache_manager: KVCacheManager
    output_processor: OutputProcessor
    scheduler: Scheduler

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...


def fail_requests(
    engine: StepOwner, scheduler_output: SchedulerOutput, errors: dict[str, str]
) -> list[RequestOutput]:
    """Requests the runner could not sample (the pass itself worked): uncache the blocks
    they filled this step (their K/V may be what made the logits non-finite), then finish
    their prompts with the error; everyone else in the step goes on."""
    for scheduled in scheduler_output.scheduled:
        request = scheduled.request
        if request.request_id in errors:
            engine.kv_cache_manager.uncache_uncomputed_blocks(
                request, scheduled.num_computed_tokens
            )
    outputs, child_ids = engine.output_processor.fail_samples(errors)
    engine.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
    return outputs


def discard_failed_step(engine: StepOwner, scheduler_output: SchedulerOutput) -> None:
    """After a forward pass failed: its blocks were cached when allocated but their K/V may
    never have been written, so forget their hashes, then abort every prompt it scheduled
    (same-step hitters of those blocks included: they were scheduled too)."""
    prompt_ids = []
    engine.kv_cache_manager.uncache_block_ids(block_id for block_id, _ in scheduler_output.kv_loads)
    for scheduled in scheduler_output.scheduled:
        request = scheduled.request
        engine.kv_cache_manager.uncache_uncomputed_blocks(request, scheduled.num_computed_tokens)
        prompt_id = engine.output_processor.prompt_of(request.request_id)
        if prompt_id is not None:
            prompt_ids.append(prompt_id)
    engine.abort_request(dict.fromkeys(prompt_ids))
