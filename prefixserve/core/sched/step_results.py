"""What a step's sampled tokens do to a request: the records the scheduler hands on, and the
stop conditions checked after every token it appends (a request stops at the first token that
ends it, even inside a run of accepted drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.output import ModelRunnerOutput, PositionLogprobs
from prefixserve.core.sched.spec_metrics import acceptance


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, as the engine needs it to build outputs."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Logprobs of prompt tokens first_prompt_logprob_pos, first_prompt_logprob_pos + 1, ...
    # (a chunk computing positions [c, c + k) scores prompt tokens c + 1 .. c + k).
    new_prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    first_prompt_logprob_pos: int = 1
    finished: bool = False


@dataclass(slots=True)
class SchedulerStats:
    """Counters since the scheduler was built."""

    num_prompt_tokens: int = 0  # prompt tokens of admitted requests, counted once per request
    num_computed_prompt_tokens: int = 0  # prompt tokens actually run through the model
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_finished_requests: int = 0
    # Prompt tokens written to the cache at clients' breakpoints (breakpoints.py).
    num_cache_write_tokens: int = 0
    # Speculative decoding (vLLM's names): verifications with drafts, drafts, accepted drafts.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafts
        self.spec_decode_num_accepted_tokens += num_accepted

    def spec_decode_rates(self) -> dict[str, float]:
        """Acceptance rate (accepted / draft tokens) and mean accepted length (tokens a
        verification emits: 1 + accepted / verifications), 0 before any draft."""
        rate, length = acceptance(
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
        )
        return {
            "spec_decode_acceptance_rate": rate or 0.0,
            "spec_decode_mean_accepted_length": length or 0.0,
        }


def check_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> bool:
    """Set a finished status when the last sampled token ends the request."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_until_stop(
    request: Request,
    tokens: list[int],
    logprobs: list[PositionLogprobs],
    update: RequestUpdate,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> bool:
    """Append `tokens` (logprobs[i] for tokens[i], when given) to the request and the update one
    at a time, checking the stop conditions after each; the tokens after a stop are dropped.
    Returns True when the request stopped."""
    for index, token in enumerate(tokens):
        request.append_output_token_ids(token)
        update.new_token_ids.append(token)
        if index < len(logprobs):
            update.new_logprobs.append(logprobs[index])
        if check_stop(request, eos_token_ids, max_model_len):
            return True
    return False


def sampled_run(
    runner_output: ModelRunnerOutput, request_id: str, token_id: int
) -> tuple[list[int], list[int], list[PositionLogprobs]]:
    """(accepted drafts, every token the step emits for the request, their logprobs if any):
    the accepted drafts, then the token sampled after them."""
    accepted = runner_output.spec_token_ids.get(request_id, [])
    logprobs = list(runner_output.spec_logprobs.get(request_id, ()))
    last = runner_output.logprobs.get(request_id)
    if last is not None:
        logprobs.append(last)
    return accepted, [*accepted, token_id], logprobs


def forced_logprobs(request: Request, tokens: list[int]) -> list[PositionLogprobs]:
    """The logprobs of tokens a grammar forced (when the request asked for logprobs): each was
    the only token allowed, so its probability under the constrained distribution is 1 (rank 1,
    no alternatives); none were sampled, so no model logits stand behind them."""
    if request.sampling_params.logprobs is None:
        return []
    return [[(token, 0.0, 1)] for token in tokens]


def append_forced(
    request: Request,
    tokens: list[int],
    update: RequestUpdate,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> bool:
    """Append tokens a grammar forces (jump-forward), checking the stop conditions after each
    as for sampled tokens. Returns True when the request stopped."""
    logprobs = forced_logprobs(request, tokens)
    return append_until_stop(request, tokens, logprobs, update, eos_token_ids, max_model_len)
