"""The offline API, shaped like vLLM's `LLM`: batch prompts in, RequestOutputs out."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from prefixserve.core.kv_cache.reports.report import describe_report
from prefixserve.core.kv_cache.salts import derive_cache_salt, validate_cache_salt
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine_args import EngineArgs, engine_args_signature
from prefixserve.lora.config import LoRARequest
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

# A prompt: text, {"prompt": text}, {"prompt_token_ids": [...]} or {"prompt_embeds": tensor}
# (with enable_prompt_embeds), each dict optionally with "cache_salt".
PromptType = str | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt"}
# One prompt to run: token ids, its text, cache salt, params, LoRA request, prompt embeddings.
_Item = tuple[list[int], str | None, str | None, SamplingParams, LoRARequest | None, Any]


def _engine_request(item: _Item, request_id: str, cache_retention: str | None) -> EngineRequest:
    """An item as the engine takes it (one engine's or the replicas')."""
    ids, text, salt, params, lora, embeds = item
    return EngineRequest(
        request_id,
        ids,
        params,
        cache_salt=derive_cache_salt(None, salt),  # as a keyless server's client
        prompt=text,
        cache_retention=cache_retention,
        lora_request=lora,
        prompt_embeds=embeds,
    )


class LLM:
    """Generate completions for batches of prompts with one in-process engine (or, with
    `num_replicas` > 1, engine replicas on Ray routed as `prefixserve serve --replicas` does;
    `shutdown()` stops them).

    Takes every engine option of `prefixserve serve` as a keyword of the same name, less the
    dashes (`engine_args.EngineArgs`, the one list both are made from; `help(EngineArgs)` and
    `prefixserve serve --help` describe them). `model=None` loads the packaged default model;
    `loaded_model` reuses weights already loaded with `prefixserve.model.loader.loading.load_model`.
    Invalid values raise ValueError.
    """

    def __init__(self, model: str | None = None, *, loaded_model: Any = None, **options: Any):
        unknown = set(options) - {f.name for f in dataclasses.fields(EngineArgs)}
        if unknown:
            raise TypeError(f"LLM() got unknown engine options {sorted(unknown)}")
        engine_args = EngineArgs(model=model, **options)
        config = engine_args.create_engine_config()
        self._counter = itertools.count()
        self._cluster: Any = None
        if engine_args.num_replicas > 1:
            from prefixserve.cluster.ray_cluster import start_cluster

            self._cluster = start_cluster(
                config,
                engine_args.num_replicas,
                threads_per_replica=engine_args.threads_per_replica,
                routing_policy=engine_args.routing_policy,
            )
            self._tokenizer = self._cluster.tokenizer
            self.llm_engine: Any = None
        else:
            self.llm_engine = LLMEngine(config, loaded_model=loaded_model)
            self._tokenizer = self.llm_engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def shutdown(self) -> None:
        """Stop the replicas (and the Ray runtime this LLM started); nothing with one engine."""
        if self._cluster is not None:
            self._cluster.shutdown()

    # ----------------------------------------------------------------- generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        prompt_cache_retention: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order, finished.

        `sampling_params` is one SamplingParams for all prompts or one per prompt (default:
        SamplingParams()); `lora_request` likewise (None: the base model).
        `prompt_cache_retention` ("in_memory" or "24h", OpenAI's field) applies to every prompt
        of the call. A bad prompt or parameter raises ValueError before any is run.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(prompts)]
        return self._run(
            [
                (ids, text, salt, params, lora, embeds)
                for (ids, text, salt, embeds), params, lora in zip(
                    parsed, params_list, loras, strict=True
                )
            ],
            use_tqdm,
            prompt_cache_retention,
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of {"role", "content"}
        messages) or a list of them, and generate a reply for each. `tools` (OpenAI's function
        tools) are rendered by the tool-capable template (the model's own where it renders
        them, else its family's packaged one: docs/tools.md); the answers are text, which
        `prefixserve.entrypoints.chat.tool_parsers.parse_hermes` turns into calls."""
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages must be a non-empty list of messages, got {messages!r}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        params_list = self._params_list(sampling_params, len(conversations))
        loras = self._lora_list(lora_request, len(conversations))
        tokenizer = self._tokenizer
        chat_template_kwargs = dict(chat_template_kwargs or {})
        if tools:
            from prefixserve.entrypoints.chat.tool_templates import tool_template

            template = tool_template(tokenizer.hf_tokenizer, tokenizer.chat_template)
            if template is None:
                raise ValueError("this model's chat template renders no tools: give chat_template")
            chat_template_kwargs.setdefault("chat_template", template)
            chat_template_kwargs["tools"] = tools
        items = []
        for conversation, params, lora in zip(conversations, params_list, loras, strict=True):
            if not isinstance(conversation, list) or not all(
                isinstance(m, dict) for m in conversation
            ):
                raise ValueError(
                    f"a conversation must be a list of message dicts, got {conversation!r}"
                )
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            text = tokenizer.apply_chat_template_text(
                conversation,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            items.append((ids, text, None, params, lora, None))
        return self._run(items, use_tqdm)

    def _run(
        self,
        items: list[_Item],
        use_tqdm: bool,
        cache_retention: str | None = None,
    ) -> list[RequestOutput]:
        requests = [
            _engine_request(item, str(next(self._counter)), cache_retention) for item in items
        ]
        if self._cluster is not None:
            from prefixserve.cluster.offline import run_requests

            return run_requests(self._cluster, requests, use_tqdm)
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for request in requests:
                # A bad constraint raises its GrammarError (a ValueError) before it is queued.
                grammar = engine.structured_outputs.compiled(request.params.structured_outputs)
                engine.add(request, None, grammar)
                order[request.request_id] = len(order)
        except Exception:
            engine.abort_request(list(order))
            raise

        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"sampling_params must be one SamplingParams or one per prompt: got "
                f"{len(params)} for {num_prompts} prompts"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must hold SamplingParams, got {p!r}")
        return params

    @staticmethod
    def _lora_list(
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        loras = list(lora_request) if isinstance(lora_request, Sequence) else None
        if (
            loras is None
            or len(loras) != num_prompts
            or not all(r is None or isinstance(r, LoRARequest) for r in loras)
        ):
            raise ValueError(
                "lora_request must be None, one LoRARequest or one (or None) per prompt"
            )
        return loras

    def _parse_prompt(
        self, prompt: PromptType, index: int
    ) -> tuple[list[int], str | None, str | None, Any]:
        tokenizer = self._tokenizer
        if isinstance(prompt, str):
            return tokenizer.encode(prompt), prompt, None, None
        if not isinstance(prompt, dict):
            raise ValueError(
                f"prompt {index} must be a string or a dict with 'prompt' or 'prompt_token_ids', "
                f"got {type(prompt).__name__}"
            )
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt {index} has unknown keys {sorted(unknown)}; allowed: "
                f"{sorted(_PROMPT_KEYS)}"
            )
        salt = prompt.get("cache_salt")
        try:
            validate_cache_salt(salt)
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise ValueError(f"prompt {index}: prompt_token_ids must be a list of ints")
            return list(ids), prompt.get("prompt"), salt, prompt.get("prompt_embeds")
        if "prompt_embeds" in prompt:
            return [], prompt.get("prompt"), salt, prompt["prompt_embeds"]
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string")
            return tokenizer.encode(prompt["prompt"]), prompt["prompt"], salt, None
        raise ValueError(f"prompt {index} needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'")

    # ----------------------------------------------------------------- cache and metrics

    def reset_prefix_cache(self, ram_only: bool = False) -> bool:
        """Forget every cached block, in RAM and (unless `ram_only`) in the disk tier, whose
        blocks of this model are deleted for every process sharing the store; False when
        requests still hold blocks. For a cold start without touching the store, build the LLM
        with enable_kv_store=False."""
        if self._cluster is not None:
            return bool(asyncio.run(self._cluster.reset_prefix_cache(ram_only=ram_only)))
        return self.llm_engine.reset_prefix_cache(ram_only=ram_only)

    def explain(
        self, prompt: PromptType, lora_request: LoRARequest | None = None
    ) -> dict[str, Any]:
        """What `prompt` would hit in the cache now, without running it: its cache report
        (docs/cache_reports.md) plus "summary", one sentence saying how many tokens would hit
        and why the first missed block would miss (and, when a cached prompt shares part of that
        block, the first token where they part). Nothing is scheduled or counted."""
        if self._cluster is not None:
            raise ValueError("explain needs one engine: with num_replicas > 1 each has its cache")
        ids, _, salt, embeds = self._parse_prompt(prompt, 0)
        if embeds is not None:
            raise ValueError("explain takes token ids or text, not prompt_embeds")
        [lora] = self._lora_list(lora_request, 1)
        report = self.llm_engine.explain_prompt(
            ids, cache_salt=derive_cache_salt(None, salt), lora_request=lora
        )
        return {**report.to_dict(), "summary": describe_report(report)}

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters: prefix_cache_requests / queries / hits, kv_cache_usage, prompt and
        generation token counts, num_preemptions, ... (with replicas: their sums, each one's
        under "replicas", and the router's)."""
        if self._cluster is not None:
            return asyncio.run(self._cluster.get_metrics())
        return self.llm_engine.get_metrics()

    def take_kv_events(self) -> list:
        """KV-cache events since the last call; needs enable_kv_events=True (one engine: with
        replicas their events feed the router)."""
        if self._cluster is not None:
            raise ValueError("KV events feed the router with num_replicas > 1; not available")
        return self.llm_engine.take_kv_events()


LLM.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *engine_args_signature(
            inspect.Parameter("loaded_model", inspect.Parameter.KEYWORD_ONLY, default=None)
        ),
    ]
)
