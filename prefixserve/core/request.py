"""A request inside the engine: its tokens, its status and its block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint, HoldStatus
    from prefixserve.core.kv_cache.reports.report import CacheReport


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class RequestGrammar(Protocol):
    """A structured request's grammar, as the scheduler drives it."""

    error: str | None  # why the grammar failed (compile error, timeout, a refused token)
    # The grammar is complete but the request's last tokens (a forced run) are not computed
    # yet: the next step computes them, its sample is dropped, and the request stops.
    finishing: bool
    unreported: list[int]  # forced tokens appended before the first step, not yet reported

    def poll(self) -> bool | None:
        """True when compiled (the request may be admitted), None while compiling, False when
        it failed (`error`)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block until the compile is done or `timeout_s` passed."""
        ...

    def accept(self, token_ids: list[int]) -> bool:
        """The request emitted these tokens; False (with `error`) when the grammar refuses one."""
        ...

    def take_forced(self) -> list[int]:
        """With jump-forward, the tokens the grammar forces now, to append as one chunk."""
        ...

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The leading drafts the grammar allows."""
        ...

    @property
    def stopped(self) -> bool:
        """The answer is complete: the grammar allows nothing more."""
        ...


# A block hasher returns the hashes of the request's blocks that became full since it was last
# called (see kv_cache.hashing.get_request_block_hasher).
BlockHasher = Callable[["Request"], list[Any]]


@dataclass(slots=True)
class CacheAccounting:
    """What the prefix cache did for one request, in one record (`Request.cache`): filled by the
    scheduler and the explainer, read by the output processor and the reports."""

    # The part of `Request.num_cached_tokens` loaded from the tiers below RAM.
    num_disk_cached_tokens: int = 0
    # Times cache-aware admission (prefix_order.py) admitted a later request before it.
    num_passed_over: int = 0
    # Its cache hit (tokens) when it was first held back for another request's prefill
    # (prefill_dedup.py; None: never).
    hit_when_waited: int | None = None
    # Of a prompt's n samples only the first is counted in the reports' metrics (the input
    # processor clears this for the others).
    counted_in_reports: bool = True
    # Its cache report at its first scheduling (kv_cache/reports/).
    report: CacheReport | None = None
    # What became of each of its breakpoints (breakpoints.py), once decided, and the prompt
    # tokens it wrote to them, in all and by ttl (seconds).
    breakpoint_statuses: list[HoldStatus] | None = None
    num_write_tokens: int = 0
    write_tokens_by_ttl: dict[int, int] = field(default_factory=dict)


class Request:
    """One sequence being generated. `n > 1` prompts become n Requests sharing a prompt."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "lora_name",
        "lora_digest",
        "cache_salt",
        "tenant",
        "cache_retention",
        "prompt_embeds",
        "all_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "block_hashes",
        "_block_hasher",
        "max_tokens",
        "stop_token_ids",
        "cache_breakpoints",
        "cache",
        "structured_output",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_embeds: Any = None,
        max_tokens: int | None = None,
        tenant: str | None = None,
        cache_retention: str | None = None,
        lora_digest: bytes | None = None,
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # The LoRA adapter the request runs with (lora/), and a digest of its files: both are
        # extra keys of every block, so no other adapter (nor this name reloaded with other
        # weights) shares its K/V.
        self.lora_name = lora_name
        self.lora_digest = lora_digest
        self.cache_salt = cache_salt
        # Who the request is for, for fair scheduling between tenants (None: the one user).
        self.tenant = tenant
        # OpenAI's prompt_cache_retention ("in_memory": never written to disk; "24h"), or None
        # for the engine's default.
        self.cache_retention = cache_retention
        # The prompt's embeddings when the request brought them instead of token ids (its
        # prompt_token_ids are then placeholders): the raw bits as a numpy array of shape
        # [num_prompt_tokens, hidden] (prompt_embeds.py); each full block's hash includes a
        # digest of its rows, and the runner feeds the rows to the model instead of embeddings
        # of the placeholder ids.
        self.prompt_embeds = prompt_embeds
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        # What the prefix cache did for it: loads, reports, breakpoints' writes.
        self.cache = CacheAccounting()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # The effective output cap (sampling max_tokens clipped by the context length).
        self.max_tokens = sampling_params.max_tokens if max_tokens is None else max_tokens
        # The scheduler checks every sampled token against these: a set, built once.
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        # The prefixes the client asked to keep (breakpoints.py), held when its prompt is
        # computed (what became of each: `cache.breakpoint_statuses`).
        self.cache_breakpoints = cache_breakpoints
        # Its grammar when its sampling params constrain the answer (structured_output/), set
        # by the engine before the scheduler sees it.
        self.structured_output: RequestGrammar | None = None
        self.block_hashes: list[Any] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def history_token_ids(self) -> list[int]:
        """The tokens a repetition penalty sees: prompt and output, or only the output when the
        prompt came as embeddings (its ids are placeholders)."""
        return self.output_token_ids if self.prompt_embeds is not None else self.all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return self.sampling_params.skips_prefix_cache_read

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
