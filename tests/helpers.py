"""Small helpers shared by tests in every folder (tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import random
import socket


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` reproducible token ids in [1000, 20000): inside every packaged model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_random_adapter(
    path, config, rank: int = 4, targets=("q_proj", "v_proj"), seed: int = 0, std: float = 0.05
):
    """A PEFT LoRA adapter directory for the model `config` (a prefixserve ModelConfig) with
    random A and B, written as peft lays it out (adapter_config.json, adapter_model.safetensors);
    returns `path`. For tests that need an adapter of a real model without loading it in
    transformers."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from prefixserve.lora.adapter import module_shapes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_f, out_f = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": "test-base",
    }
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path
