"""SchedulerOutput -> tensors -> one forward over the paged KV cache -> sampled tokens.

The runner owns the KV cache tensors (per layer K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`; block 0 is the null block) and the per-request random generators. It
never mutates a Request: it reads token ids and sampling params and returns a ModelRunnerOutput.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from prefixserve.batch import ModelRunnerOutput, PositionLogprobs, SchedulerOutput
from prefixserve.kv_cache.spec import SlidingWindowSpec
from prefixserve.model.attention import ScheduledSpan, build_attention_metadata
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import paged_attention_kernel
from prefixserve.model.layers import ForwardContext
from prefixserve.request import Request


class SamplerLike(Protocol):
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        generators: list[torch.Generator | None],
    ) -> list[tuple[int, PositionLogprobs | None]]: ...


class ModelRunner:
    """Runs the model for the scheduler's steps.

    `model` is a model from `prefixserve.model.registry.create_model` and `config` its
    ModelConfig. `num_blocks` counts the null block 0.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        sampler: SamplerLike | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                "num_blocks must be an integer >= 2 (block 0 is the null block), "
                f"got {num_blocks!r}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if sampler is None:
            from prefixserve.model.sampler import Sampler

            sampler = Sampler()
        self.model: nn.Module = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sampler = sampler
        self.group_windows = [
            spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            for spec in config.kv_cache_groups()
        ]
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeroed: masked-out slots that were never written are still read, and 0 * NaN = NaN.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=config.torch_dtype),
                torch.zeros(shape, dtype=config.torch_dtype),
            )
            for _ in range(config.num_layers)
        ]
        # The compiled paged-attention kernel (built on first use), or None: PyTorch paths.
        self.attention_kernel = paged_attention_kernel()
        self.generator = torch.Generator().manual_seed(seed)
        self._seeded_generators: dict[str, torch.Generator] = {}

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._seeded_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._seeded_generators[request.request_id] = gen
        return gen

    def release(self, finished_req_ids: Iterable[str]) -> None:
        """Drop what the runner keeps for requests that finished (their seeded generators)."""
        for req_id in finished_req_ids:
            self._seeded_generators.pop(req_id, None)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward over all scheduled chunks; sample where a chunk reaches its last token."""
        self.release(scheduler_output.finished_req_ids)
        output = ModelRunnerOutput()
        # Single-token chunks first: attention serves them as one batched call.
        scheduled = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens != 1)
        if not scheduled:
            return output

        num_groups = len(self.group_windows)
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[ScheduledSpan] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[Request, int]] = []  # (request, number of rows)
        for s in scheduled:
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            end = start + n
            if n < 1 or end > req.num_tokens:
                raise ValueError(
                    f"request {req.request_id!r}: cannot compute tokens [{start}, {end}) of "
                    f"{req.num_tokens}"
                )
            if len(s.block_ids) != num_groups:
                raise ValueError(
                    f"request {req.request_id!r}: {len(s.block_ids)} block tables for "
                    f"{num_groups} KV-cache groups"
                )
            row = len(token_ids)
            token_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            spans.append(ScheduledSpan(start, n, s.block_ids))
            if s.samples:
                sample_rows.append(row + n - 1)
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None:
                # Logits at position p score prompt token p + 1.
                last = min(end, req.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.extend(range(row, row + last - start))
                    prompt_targets.extend(req.all_token_ids[start + 1 : last + 1])
                    prompt_owners.append((req, last - start))

        metadata = [
            build_attention_metadata(spans, g, self.block_size, window, self.attention_kernel)
            for g, window in enumerate(self.group_windows)
        ]
        ctx = ForwardContext(
            positions=torch.tensor(positions, dtype=torch.int64),
            kv_caches=self.kv_caches,
            groups=metadata,
        )
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64), ctx)
        rows = sample_rows + prompt_rows
        if not rows:
            return output
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64)])

        if sample_reqs:
            generators = [self._generator_for(r) for r in sample_reqs]
            results = self.sampler(logits[: len(sample_reqs)], sample_reqs, generators)
            for req, (token_id, logprobs) in zip(sample_reqs, results, strict=True):
                output.sampled_token_ids[req.request_id] = int(token_id)
                if logprobs is not None:
                    output.logprobs[req.request_id] = logprobs
        if prompt_owners:
            compute = getattr(self.sampler, "compute_prompt_logprobs", None)
            if compute is None:
                from prefixserve.model.sampler import compute_prompt_logprobs as compute
            offset = len(sample_reqs)
            for req, count in prompt_owners:
                output.prompt_logprobs[req.request_id] = compute(
                    logits[offset : offset + count],
                    prompt_targets[offset - len(sample_reqs) : offset - len(sample_reqs) + count],
                    req.sampling_params.prompt_logprobs,
                )
                offset += count
        return output
