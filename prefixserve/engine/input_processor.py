"""Requests in (vLLM's input processor): an `EngineRequest` (prompt or embeddings, params, salt,
tenant, retention, adapter, breakpoints) checked and turned into one `Request` per sample
(`n > 1` fans out into n Requests whose prompt blocks are shared through the prefix cache); and
the probes the operator controls hash a prompt with (`probe`). An `EngineRequest`'s fields
become a `Request`'s here, in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.core.kv_cache.breakpoint_spec import request_breakpoints
from prefixserve.core.request import Request
from prefixserve.engine.builder import EngineParts
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.input_checks import (
    check_fits_pool,
    check_prompt,
    check_request_fields,
    effective_max_tokens,
)
from prefixserve.inputs.prompt_embeds import prompt_from_embeds
from prefixserve.lora.config import LoRARequest
from prefixserve.sampling_params import SamplingParams

InUse = Callable[[str], int]


class InputProcessor:
    """Checks requests against the engine's model, context, pool and adapters."""

    def __init__(self, config: EngineConfig, parts: EngineParts) -> None:
        self.config = config
        self.parts = parts
        self.model_config = parts.loaded_model.config
        self.max_model_len = parts.max_model_len

    def requests_for(
        self, request: EngineRequest, lora_in_use: InUse, lora_read: Any = None
    ) -> tuple[list[int], list[Request]]:
        """The checked prompt token ids and one Request per sample of `request`. ValueError
        (naming the field) for a bad field, an empty prompt, token ids outside the vocabulary,
        a prompt or max_tokens past max_model_len, or a request too long for the KV pool;
        `lora_read`: the adapter `LoRAManager.read` made of its `lora_request` off this thread."""
        params = request.params
        check_request_fields(
            request.request_id, params, request.cache_salt, request.cache_retention
        )
        prompt_ids, embeds_bits = self._prompt(request)
        num_prompt = len(prompt_ids)
        breakpoints = request_breakpoints(
            request.cache_breakpoints, request.cache_retention, num_prompt
        )
        max_tokens = effective_max_tokens(params, num_prompt, self.max_model_len)
        # The last sampled token never gets K/V, so the longest sequence caches this many tokens.
        needed = self.parts.blocks_needed(num_prompt + max_tokens - 1)
        check_fits_pool(needed, num_prompt, max_tokens, self.parts.num_kv_blocks)
        lora_name, lora_digest = self._adapter(request.lora_request, lora_in_use, lora_read)
        requests = [
            Request(
                child_id,
                prompt_ids,
                child_params,
                block_hasher=self.parts.block_hasher,
                cache_salt=request.cache_salt,
                max_tokens=max_tokens,
                tenant=request.tenant,
                cache_retention=request.cache_retention,
                lora_name=lora_name,
                lora_digest=lora_digest,
                prompt_embeds=embeds_bits,
                cache_breakpoints=breakpoints,
            )
            for child_id, child_params in _samples(request.request_id, params)
        ]
        for sample in requests[1:]:
            sample.cache.counted_in_reports = False  # a prompt's samples are one request to count
        manager = self.parts.kv_cache_manager  # pinned blocks are not the request's to take
        available = manager.held.blocks_available_to(requests[0])
        check_fits_pool(needed, num_prompt, max_tokens, available, manager.held.num_blocks)
        return prompt_ids, requests

    def probe(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """A Request that is never scheduled, hashed as a real one would be: what a pin or an
        explanation looks the prompt up with. ValueError for a bad field or prompt, or an
        adapter that is not loaded (nothing of it can be cached)."""
        check_request_fields(request_id, SamplingParams(), cache_salt, None)
        ids = check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        lora_name = lora_digest = None
        if lora_request is not None:
            lora = self.parts.lora
            adapter = lora.adapters.get(lora_request.lora_name) if lora else None
            if adapter is None:
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r} is not loaded: load it (or run a "
                    "request with it) first"
                )
            lora_name, lora_digest = adapter.name, adapter.digest
        return Request(
            request_id,
            ids,
            SamplingParams(),
            block_hasher=self.parts.block_hasher,
            cache_salt=cache_salt,
            tenant=tenant,
            lora_name=lora_name,
            lora_digest=lora_digest,
        )

    def _prompt(self, request: EngineRequest) -> tuple[list[int], Any]:
        """The prompt's checked token ids, and its embeddings' bits when it brings embeddings
        (its token ids are then placeholders)."""
        prompt_ids, embeds_bits = request.prompt_token_ids, None
        if request.prompt_embeds is not None:
            if not self.config.enable_prompt_embeds:
                raise ValueError(
                    "prompt_embeds are not enabled: build the engine with "
                    "enable_prompt_embeds=True (--enable-prompt-embeds)"
                )
            prompt_ids, embeds_bits = prompt_from_embeds(
                prompt_ids, request.prompt_embeds, request.params, self.model_config,
                self.max_model_len,
            )  # fmt: skip
        ids = check_prompt(prompt_ids, self.model_config.vocab_size, self.max_model_len)
        return ids, embeds_bits

    def _adapter(
        self, lora_request: LoRARequest | None, lora_in_use: InUse, lora_read: Any
    ) -> tuple[str | None, bytes | None]:
        """The adapter's name and digest (loaded now if needed: only for a request that fits),
        or (None, None) without one."""
        if lora_request is None:
            return None, None
        if self.parts.lora is None:
            raise ValueError("this engine serves no LoRA adapters: build it with enable_lora=True")
        adapter = self.parts.lora.resolve(lora_request, lora_in_use, lora_read)
        return adapter.name, adapter.digest


def _samples(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(child id, params) of each of `params.n` samples: one seed each (consecutive from the
    prompt's), and only sample 0 computes prompt logprobs (the others neither compute them
    nor skip the prefix cache for them)."""
    if params.n == 1:
        return [(request_id, params)]
    samples = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        prompt_logprobs = params.prompt_logprobs if index == 0 else None
        child = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
        samples.append((f"{index}_{request_id}", child))
    return samples
