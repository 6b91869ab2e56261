"""The structured-output manager (vLLM v1's StructuredOutputManager): the one object the engine
holds for grammars. It owns the backend, the compile thread and cache (`compiler.py`) and the
mask thread, gives each structured request its `GrammarState`, and starts each step's masks.
The scheduler sees only the requests' states (core/sched/interfaces.py, `RequestGrammar`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefixserve.config import StructuredOutputsConfig
from prefixserve.core.request import Request
from prefixserve.core.sched.output import SchedulerOutput
from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.backend import LLGuidanceBackend
from prefixserve.structured_output.compiler import GrammarCompiler
from prefixserve.structured_output.errors import GrammarError
from prefixserve.structured_output.request_state import GrammarState
from prefixserve.structured_output.step_masks import StepMasks

# How often a caller awaiting a compile checks whether it is overdue.
_POLL_S = 0.05


class StructuredOutputManager:
    """Grammars for one engine: compile (`ahead`, `attach`) and mask (`start_step`)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        config: StructuredOutputsConfig | None = None,
        logits_width: int | None = None,
    ) -> None:
        """`vocab_size`: the tokenizer's; `logits_width`: the model's logits (its vocabulary,
        padded; the tokenizer's by default)."""
        self.config = config or StructuredOutputsConfig()
        self.vocab_size = vocab_size
        self.logits_width = logits_width or vocab_size
        self.backend = LLGuidanceBackend(hf_tokenizer, vocab_size, eos_token_ids)
        self.compiler = GrammarCompiler(
            self.backend,
            timeout_s=self.config.compile_timeout_s,
            max_compiles_per_tenant=self.config.max_compiles_per_tenant,
            max_cached_per_tenant=self.config.max_cached_grammars_per_tenant,
            max_cached_chars=self.config.max_cached_grammar_chars,
        )
        self._mask_executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    async def ahead(self, params: StructuredOutputsParams, tenant: Hashable = None) -> Future:
        """Compile (or find cached) a request's grammar before it is queued, off the caller's
        loop: the server answers a bad constraint with a 400 and a busy tenant with a 429
        (GrammarError / GrammarBusy) before any header is sent. Returns the compile, for
        `attach`."""
        job = self.compiler.get(params, tenant)
        wrapped = asyncio.wrap_future(job)
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(wrapped), _POLL_S)
                return job
            except TimeoutError:
                if job.overdue(self.config.compile_timeout_s):
                    raise self.compiler.timed_out(params) from None
            except GrammarError as exc:
                self.compiler.count_rejection(exc.reason)
                raise

    def compiled(self, params: StructuredOutputsParams | None) -> Future | None:
        """The offline API's compile (the one user), waited for here: GrammarError raises before
        the request is queued, as any bad parameter does. None for None."""
        if params is None:
            return None
        future = self.compiler.get(params, None)
        self.compiler.wait(future, params)
        return future

    def attach(self, request: Request, compiled: Future | None = None) -> None:
        """Give a structured request its grammar state: `compiled` (what `ahead` returned), or
        its compile queued or found now. A compile that already failed raises its GrammarError
        here; one still running is waited for by the scheduler, which admits the request once
        it is ready."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        future = compiled if compiled is not None else self.compiler.get(params, request.tenant)
        state = GrammarState(
            future,
            self.config.jump_forward,
            self.config.compile_timeout_s,
            self.compiler.count_rejection,
            vocab_size=self.vocab_size,
        )
        if future.done() and future.exception() is not None:
            exc = future.exception()
            self.compiler.count_rejection(getattr(exc, "reason", "invalid_grammar"))
            raise exc
        request.structured_output = state

    def start_step(self, output: SchedulerOutput) -> StepMasks | None:
        """The step's masks, filling on the mask thread (None when no structured request
        samples this step)."""
        if not any(s.request.structured_output is not None for s in output.scheduled):
            return None
        return StepMasks(output, self.vocab_size, self.logits_width, self._mask_executor)

    def metrics(self) -> dict[str, Any]:
        stats = self.compiler.stats
        return {
            "structured_output_compiles": stats.compiles,
            "structured_output_cache_hits": stats.cache_hits,
            "structured_output_compile_seconds": stats.compile_seconds,
            **{f"structured_output_rejections_{r}": n for r, n in stats.rejections.items()},
            "structured_output_cached_grammars": self.compiler.num_cached,
        }

    def close(self) -> None:
        self.compiler.close()
        self._mask_executor.shutdown(wait=False, cancel_futures=True)
