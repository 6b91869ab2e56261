"""The operator's controls over the cache, beside the step loop: the cache-wide summary, the
held breakpoints, a prompt's cache report without running it, the prefix-cache reset, and pins.
Built from the parts they act on (the KV-cache manager, the scheduler, the tiers' connector,
the explainer and the input processor's probes), not from the engine; the engine offers them
on its interface and runs them on its step thread.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from prefixserve.core.kv_cache.reports.report import CacheReport
from prefixserve.engine.builder import EngineParts
from prefixserve.engine.cache_summary import build_cache_summary
from prefixserve.engine.input_processor import InputProcessor
from prefixserve.lora.config import LoRARequest


class OperatorControls:
    """Summary, breakpoints, explain, reset and pins over an engine's `parts`. `decode` turns
    token ids into text (the summary's prefix text); `kv_cache` is how the pool stores K/V
    (`{"dtype", "bytes_per_token"}`, for the summary)."""

    def __init__(
        self,
        parts: EngineParts,
        processor: InputProcessor,
        decode: Callable[[list[int]], str],
        kv_cache: dict[str, Any],
    ) -> None:
        self.manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.connector = parts.kv_connector
        self.explainer = parts.explainer
        self.blocks_needed = parts.blocks_needed
        self.processor = processor
        self.decode = decode
        self.kv_cache = kv_cache

    def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        """The cache-wide summary operators read (`engine/cache_summary.py`); prefix text only
        with `include_text`. `build_s`: the seconds building it took (on the step thread)."""
        start = time.perf_counter()
        decode = self.decode if include_text else None
        summary = build_cache_summary(
            self.manager, self.explainer, self.connector, decode, dict(self.kv_cache)
        )
        summary["breakpoints"] = self.describe_breakpoints()
        # Its own time, for the callers that space rebuilds by it (summary_feed.SummaryFeed).
        summary["build_s"] = time.perf_counter() - start
        return summary

    def describe_breakpoints(self) -> dict[str, Any]:
        """Clients' held breakpoints: per tenant {"breakpoints", "blocks", "tokens"}, the blocks
        held in all, the bounds, and the prompt tokens written at breakpoints so far."""
        held = self.manager.held.breakpoints
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
        probe = self.processor.probe(
            f"explain-{uuid.uuid4().hex}",  # never a real request id
            prompt_token_ids,
            cache_salt,
            tenant=tenant,
            lora_request=lora_request,
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
        if self.connector is not None and not ram_only:
            self.connector.clear()
        if self.connector is not None:
            self.connector.release_pins()  # the reset dropped every pin
        return True

    def pin_prefix(
        self, pin_id: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> int:
        """Keep the cached blocks of this prompt (under `cache_salt`) resident in the pool until
        `unpin_prefix`; returns the tokens pinned. Run the prompt first so it is cached.
        ValueError for bad input, nothing cached, a used id or a full pinned capacity."""
        probe = self.processor.probe(pin_id, prompt_token_ids, cache_salt)
        num_tokens = self.manager.held.pin_prefix(pin_id, probe)
        unfit = self._first_unfit_request()
        if unfit is not None:
            self.unpin_prefix(pin_id)
            raise ValueError(
                f"pinning {pin_id!r} would leave queued request {unfit!r} unable to ever get "
                "its KV blocks; pin it when that request has finished"
            )
        if self.connector is not None:  # the tiers below RAM keep its blocks too
            self.connector.pin(pin_id, probe, num_tokens)
        return num_tokens

    def _first_unfit_request(self) -> str | None:
        """The id of an unfinished request that needs more blocks than it can hold with the
        current pins (see `check_fits_pool`), or None."""
        for request in self.scheduler.requests.values():
            needed = self.blocks_needed(request.num_prompt_tokens + request.max_tokens - 1)
            if needed > self.manager.held.blocks_available_to(request):
                return request.request_id
        return None

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin (its blocks stay cached, evictable again; on the tiers below RAM they
        expire a retention (24 h) from now); False when there is none."""
        if self.connector is not None:
            self.connector.release_pins(pin_id)
        return self.manager.held.pins.unpin(pin_id)

    def describe_pins(self) -> dict[str, Any]:
        """{"pins": {id: {"num_tokens", "num_blocks"}}, "pinned_blocks", "capacity_blocks"}."""
        pins = self.manager.held.pins
        return {
            "pins": pins.describe(),
            "pinned_blocks": pins.num_blocks,
            "capacity_blocks": pins.capacity_blocks,
        }
