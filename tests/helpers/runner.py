"""A harness around our ModelRunner with no scheduler: a sampler that records the logits it is
given, block ids per KV-cache group, one step of (request, computed, new, block ids) entries, and
`greedy_generate` (a plain argmax loop over a loaded model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.core.request import Request
from prefixserve.core.sched.output import PositionLogprobs, ScheduledRequest, SchedulerOutput
from prefixserve.model.config import ModelConfig
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import ModelRunner
from tests.helpers.models import build_ours


class RecordingSampler:
    """Greedy sampler that keeps the logits it was given, per request id, in call order."""

    def __init__(self) -> None:
        self.sampled: dict[str, list[torch.Tensor]] = {}
        self.prompt: list[torch.Tensor] = []

    def __call__(self, logits, requests, generators) -> list[tuple[int, PositionLogprobs | None]]:
        assert logits.dtype == torch.float32 and logits.shape[0] == len(requests)
        assert len(generators) == len(requests)
        out = []
        for row, req in zip(logits, requests, strict=True):
            self.sampled.setdefault(req.request_id, []).append(row.clone())
            out.append((int(row.argmax()), None))
        return out

    def compute_prompt_logprobs(self, logits, target_ids, num_top) -> list[PositionLogprobs]:
        assert logits.shape[0] == len(target_ids)
        self.prompt.append(logits.clone())
        lp = torch.log_softmax(logits, dim=-1)
        return [[(t, float(lp[i, t]), 1)] for i, t in enumerate(target_ids)]


class BlockAllocator:
    """Hands out distinct block ids per KV-cache group (block 0 is the null block)."""

    def __init__(self, num_groups: int) -> None:
        self.next = [1] * num_groups

    def take(self, group: int, count: int) -> list[int]:
        ids = list(range(self.next[group], self.next[group] + count))
        self.next[group] += count
        return ids


@dataclass
class Harness:
    model: torch.nn.Module
    config: ModelConfig
    runner: ModelRunner
    sampler: RecordingSampler
    block_size: int

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_cache_groups())


def make_harness(
    hf_model: torch.nn.Module, config_json: dict, block_size: int = 4, num_blocks: int = 64
) -> Harness:
    model, config = build_ours(hf_model, config_json)
    sampler = RecordingSampler()
    runner = ModelRunner(
        model, config, num_blocks=num_blocks, block_size=block_size, sampler=sampler
    )
    # Poison the null block: any read of it would turn logits into NaN.
    for k, v in runner.kv_caches:
        k[0].fill_(float("nan"))
        v[0].fill_(float("nan"))
    return Harness(model, config, runner, sampler, block_size)


def greedy_request(req_id: str, prompt: list[int], prompt_logprobs: int | None = 0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=32, prompt_logprobs=prompt_logprobs)
    return Request(req_id, prompt, params)


def step(h: Harness, entries: list[tuple[Request, int, int, tuple[list[int], ...]]]):
    """Run one step of (request, num_computed, num_new, block_ids) entries."""
    scheduled = [ScheduledRequest(r, c, n, ids) for r, c, n, ids in entries]
    return h.runner.execute(SchedulerOutput(scheduled))


def greedy_generate(loaded, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through our ModelRunner with a plain argmax loop: one prefill step, then
    one decode step per token, stopping at an eos id. No scheduler, no engine."""

    def argmax(logits, requests, generators):
        return [(int(row.argmax()), None) for row in logits]

    block_size = 16
    num_blocks = (len(prompt_ids) + max_new_tokens) // block_size + 2
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        num_blocks=num_blocks + 1,
        block_size=block_size,
        sampler=argmax,
    )
    block_ids = tuple(list(range(1, num_blocks + 1)) for _ in loaded.config.kv_cache_groups())
    request = Request("greedy", prompt_ids, SamplingParams(temperature=0.0))
    computed, new = 0, len(prompt_ids)
    for _ in range(max_new_tokens):
        out = runner.execute(SchedulerOutput([ScheduledRequest(request, computed, new, block_ids)]))
        token = out.sampled_token_ids["greedy"]
        request.append_output_token_ids(token)
        if token in loaded.tokenizer.eos_token_ids:
            break
        computed, new = request.num_tokens - 1, 1
    return request.output_token_ids
