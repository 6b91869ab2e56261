"""The contract between the scheduler and the model runner for one engine step.

The scheduler decides, per request, how many new tokens to compute this step and which KV blocks
hold its history; the runner turns that into tensors, runs one forward pass and samples.
Both live in one process, so a scheduled entry carries the Request itself: the runner reads its
token ids, sampling params and output history (for penalties) from it and never mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixserve.core.request import Request

if TYPE_CHECKING:
    from prefixserve.core.sched.interfaces import StepGrammar


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    # Tokens request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
    # are computed this step, at positions with the same indices.
    num_computed_tokens: int
    num_new_tokens: int
    # One block-id list per KV-cache group (group order = KVCacheConfig.groups order). Entry i
    # holds positions [i * block_size, (i + 1) * block_size). Block id 0 is the null block: a
    # placeholder for blocks a sliding-window group released; its contents are never read.
    block_ids: tuple[list[int], ...]
    # Speculative drafts (spec_decode/) computed after the request's last token, at positions
    # num_tokens, num_tokens + 1, ... in lookahead slots: verified this step, never cached. Only
    # a chunk that `samples` has drafts. Not counted in num_new_tokens.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows of the forward pass: the new tokens and the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests finished or aborted since the previous step: the runner drops any per-request
    # state it keeps for them (seeded generators). Preempted requests are NOT listed: they
    # resume later and must continue their random stream.
    finished_req_ids: set[str] = field(default_factory=set)
    # (block id, payload) of blocks loaded from the disk tier (kv_store/): the runner writes
    # them into the KV cache before the forward pass; they count as computed tokens.
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    # The structured requests' token masks (structured_output/step_masks.py), set by the engine
    # after scheduling and filled while the forward pass runs; None when no request has one.
    grammar: StepGrammar | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


# One position's logprobs: the chosen token's (token_id, logprob, rank) first, then the top-N
# (token_id, logprob, rank) in descending order. rank is 1-based.
PositionLogprobs = list[tuple[int, float, int]]


@dataclass(slots=True)
class ModelRunnerOutput:
    # request_id -> sampled token id, for every scheduled request whose chunk `samples`.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request_id -> logprobs of the sampled token (only when sampling_params.logprobs is set).
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # request_id -> logprobs of prompt positions 1.. covered by this chunk, in order (only when
    # sampling_params.prompt_logprobs is set). Prompt position 0 has no logprob (vLLM: None).
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request_id -> the drafts the step accepted (a prefix of its draft_token_ids), emitted
    # before sampled_token_ids[request_id]; absent when it had no drafts or none stood.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> logprobs of each accepted draft (with logprobs set and drafts accepted).
    spec_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request_id -> why it could not be sampled this step (its seed, non-finite logits, a sampler
    # error on its row). The forward pass itself succeeded; the engine fails only these requests.
    failed: dict[str, str] = field(default_factory=dict)
