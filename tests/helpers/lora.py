"""Tiny random-weight models with PEFT adapters made by peft itself, and our engine around them.

The transformers models come from tests.helpers.models (fp32, weights ~N(0, 0.1)). An
adapter is peft's `get_peft_model` over a copy of the model with `init_lora_weights=False`
(random A and B, so the adapter visibly moves the logits), saved with `save_pretrained`: the
directory our loader reads is exactly what peft writes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import torch

from prefixserve import LLM
from prefixserve.model.loader.loading import LoadedModel
from tests.helpers.models import VOCAB, build_hf_model, build_ours, hf_config

__all__ = [
    "VOCAB",
    "build_hf_model",
    "hf_config",
    "make_adapter",
    "our_llm",
    "hf_greedy",
    "hf_logprobs",
]


def make_adapter(
    hf_model: torch.nn.Module,
    path: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: list[str] | str = ("q_proj", "v_proj"),
    seed: int = 0,
    use_rslora: bool = False,
) -> torch.nn.Module:
    """Save a random LoRA adapter for `hf_model` at `path`; return the peft model (fp32, eval)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets) if not isinstance(targets, str) else targets,
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return model.eval()


def our_llm(hf_model: torch.nn.Module, config_json: dict, tokenizer, **kwargs) -> LLM:
    """Our engine over the same weights in fp32, with LoRA on."""
    model, config = build_ours(hf_model, config_json)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, config=config, path=Path("."))
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("enable_lora", True)
    kwargs.setdefault("max_lora_rank", 32)
    return LLM(dtype="float32", loaded_model=loaded, enable_kv_store=False, **kwargs)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1."""
    logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
