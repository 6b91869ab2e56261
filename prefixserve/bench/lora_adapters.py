"""Random LoRA adapters for a model, written as PEFT writes them (`adapter_config.json`,
`adapter_model.safetensors`), so that prefixserve and vLLM load the same files: for the LoRA
benchmarks (`benchmarks/bench_lora.py`, `prefixserve bench compare --lora-adapters`) and for
tests that need an adapter of a real model without loading it in transformers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixserve.lora.adapter import module_shapes
from prefixserve.model.config import ModelConfig

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = {"gate_proj", "up_proj", "down_proj"}


def write_random_adapter(
    path: str | Path,
    config: ModelConfig,
    rank: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    std: float = 0.05,
    base_model: str = "base",
) -> Path:
    """A PEFT LoRA adapter directory at `path` for the model `config`, A and B ~ N(0, std),
    `lora_alpha = 2 * rank`; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            block = "mlp" if module in _MLP else "self_attn"
            in_f, out_f = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config_json, indent=1))
    return path
