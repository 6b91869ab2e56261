"""Sampled tokens -> what the caller sees: text, stop strings, held-back text, logprobs.

The vLLM name for this room. The engine registers each prompt with its samples (one Request per
sample, `n` of them), hands over every step's RequestUpdates, and gets back the RequestOutputs of
the prompts that moved, plus the samples a stop string ended (the engine finishes them in the
scheduler). Nothing here touches the KV cache or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixserve.core.kv_cache.breakpoints import breakpoint_report
from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.output import PositionLogprobs
from prefixserve.core.sched.step_results import RequestUpdate
from prefixserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from prefixserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from prefixserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleState:
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
class PromptState:
    """One add_request call: a prompt and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass(slots=True)
class ProcessedOutputs:
    """What one step's updates gave: outputs for the caller, and samples to finish because a
    stop string ended them (`(request_id of the sample, stop string)`)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[tuple[str, str]] = field(default_factory=list)
    # Sample request ids the engine must finish in the scheduler because their prompt failed.
    failed: list[str] = field(default_factory=list)


class OutputProcessor:
    """Keeps each unfinished prompt's output state, keyed by prompt id and by sample id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, PromptState] = {}
        self._sample_of: dict[str, tuple[PromptState, SampleState]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._prompts

    def has_unfinished(self) -> bool:
        return bool(self._prompts)

    def prompt_ids(self) -> list[str]:
        return sorted(self._prompts)

    def add_prompt(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        requests: list[Request],
    ) -> None:
        """Track a prompt whose samples are `requests` (in sample order). The engine's one check
        of a duplicate id: ValueError when the id or a sample's id is already tracked."""
        if request_id in self._prompts:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for request in requests:
            if request.request_id in self._sample_of:
                raise ValueError(f"request_id {request_id!r} collides with a running sample id")
        entry = PromptState(request_id, prompt, prompt_token_ids)
        if params.prompt_logprobs is not None:
            entry.prompt_logprobs = [None]
        stop_buffer = max((len(s) for s in params.stop_strings), default=1) - 1
        for index, request in enumerate(requests):
            sample = SampleState(
                index=index,
                request=request,
                detokenizer=self.tokenizer.incremental_detokenizer(prompt_token_ids),
                stop_buffer=stop_buffer,
                logprobs=[] if params.logprobs is not None else None,
            )
            entry.samples.append(sample)
            self._sample_of[request.request_id] = (entry, sample)
        self._prompts[request_id] = entry

    def remove_prompt(self, request_id: str) -> list[str]:
        """Stop tracking a prompt; returns its samples' request ids (empty when unknown)."""
        entry = self._prompts.pop(request_id, None)
        if entry is None:
            return []
        for sample in entry.samples:
            del self._sample_of[sample.request.request_id]
        return [sample.request.request_id for sample in entry.samples]

    def prompt_of(self, sample_request_id: str) -> str | None:
        """The prompt id a sample's request id belongs to, if it is still tracked."""
        found = self._sample_of.get(sample_request_id)
        return None if found is None else found[0].request_id

    def process_updates(self, updates: list[RequestUpdate]) -> ProcessedOutputs:
        """Apply one step's updates; the outputs (cumulative text and token ids, `finished` on a
        prompt's last output) of prompts that got new tokens or finished. Finished prompts are
        forgotten."""
        result = ProcessedOutputs()
        touched: dict[str, PromptState] = {}
        for update in updates:
            found = self._sample_of.get(update.request.request_id)
            if found is None:
                continue
            entry, sample = found
            if entry.error is not None:
                continue
            try:
                stop = self._apply_update(entry, sample, update)
            except Exception as exc:  # noqa: BLE001 - this prompt fails, the others go on
                result.failed.extend(self._fail(entry, sample, f"detokenizing failed: {exc!r}"))
                touched[entry.request_id] = entry
                continue
            if stop is not None:
                result.stopped.append((sample.request.request_id, stop))
            if update.new_token_ids or sample.finished:
                touched[entry.request_id] = entry
        for entry in touched.values():
            finished = entry.finished
            result.outputs.append(self._make_output(entry, finished))
            if finished:
                self.remove_prompt(entry.request_id)
        return result

    def fail_samples(self, errors: dict[str, str]) -> tuple[list[RequestOutput], list[str]]:
        """Fail the prompts of the samples in `errors` (sample request id -> why): their final
        outputs (finished, with `error`), and every sample request id the engine must finish in
        the scheduler. The prompts are forgotten; unknown ids are ignored."""
        outputs: list[RequestOutput] = []
        child_ids: list[str] = []
        for sample_id, message in errors.items():
            found = self._sample_of.get(sample_id)
            if found is None:
                continue  # its prompt failed already (a sibling) or was aborted
            entry, sample = found
            child_ids.extend(self._fail(entry, sample, message))
            outputs.append(self._make_output(entry, True))
            self.remove_prompt(entry.request_id)
        return outputs, child_ids

    @staticmethod
    def _fail(entry: PromptState, sample: SampleState, message: str) -> list[str]:
        """Mark a prompt failed by one of its samples; returns all its samples' request ids."""
        entry.error = message
        sample.finish_reason = "error"
        for other in entry.samples:
            if other.finish_reason is None:
                other.finish_reason = "abort"
        return [s.request.request_id for s in entry.samples]

    def _apply_update(
        self, entry: PromptState, sample: SampleState, update: RequestUpdate
    ) -> str | None:
        """Returns the stop string that ends a sample the scheduler has not finished yet."""
        request = update.request
        if update.new_prompt_logprobs and sample.index == 0 and entry.prompt_logprobs is not None:
            self._add_prompt_logprobs(entry, update)
        if not update.new_token_ids:
            if update.finished:  # a step that only computed (a grammar's forced tail), then ended
                sample.finish_reason = request.status.finish_reason
                sample.stop_reason = request.stop_reason
            return None
        stop, num_tokens = self._add_tokens(sample, update.new_token_ids)
        if sample.logprobs is not None:
            for position in update.new_logprobs[:num_tokens]:
                sample.logprobs.append(self._logprob_dict(position))
        full_text = sample.detokenizer.text
        if stop is not None:
            stop_string, cut = stop
            sample.text = full_text[:cut]
            sample.finish_reason = "stop"
            sample.stop_reason = stop_string
            if not update.finished:
                return stop_string  # the engine finishes it in the scheduler
            # Finished by the scheduler this step (EOS, length): the stop string wins.
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
            return None
        sample.text = full_text
        if update.finished:
            sample.finish_reason = request.status.finish_reason
            sample.stop_reason = request.stop_reason
        return None

    def _add_tokens(
        self, sample: SampleState, token_ids: list[int]
    ) -> tuple[tuple[str, int] | None, int]:
        """Detokenize a step's tokens; returns the stop string they complete (see
        `_find_stop_string`) and how many of them stand. Several tokens in a step (accepted
        drafts) with stop strings set go one at a time: the tokens after the one completing a
        stop string are dropped from the request, as if decoding had stopped there."""
        if len(token_ids) == 1 or not sample.request.sampling_params.stop_strings:
            sample.detokenizer.add_tokens(token_ids)
            return self._find_stop_string(sample.detokenizer.text, sample), len(token_ids)
        for index, token_id in enumerate(token_ids):
            sample.detokenizer.add_tokens([token_id])
            stop = self._find_stop_string(sample.detokenizer.text, sample)
            if stop is not None:
                extra = len(token_ids) - index - 1
                if extra:
                    request = sample.request
                    del request.output_token_ids[-extra:]
                    del request.all_token_ids[-extra:]
                return stop, index + 1
        return None, len(token_ids)

    @staticmethod
    def _find_stop_string(text: str, sample: SampleState) -> tuple[str, int] | None:
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

    def _add_prompt_logprobs(self, entry: PromptState, update: RequestUpdate) -> None:
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

    def _make_output(self, entry: PromptState, finished: bool) -> RequestOutput:
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
            num_disk_cached_tokens=first.cache.num_disk_cached_tokens,
            num_cache_write_tokens=first.cache.num_write_tokens,
            cache_write_tokens_by_ttl=dict(first.cache.write_tokens_by_ttl),
            cache_report=_report_dict(first),
            finished=finished,
            error=entry.error,
        )


def _report_dict(request: Request) -> dict[str, Any] | None:
    """The request's cache report as clients get it, when asked for; with breakpoints, what
    became of each and `miss_at_breakpoint`: the first one whose prefix was not read from the
    cache (None when all were, or before they are decided)."""
    if request.cache.report is None or not request.sampling_params.cache_report:
        return None
    report = request.cache.report.to_dict()
    if request.cache_breakpoints:
        report.update(breakpoint_report(request))
    return report
