"""Tiny random-weight transformers models of each family, and ours over the same weights.

`build_hf_model` is the one builder: every test that needs a model directory other than the
packaged one makes it here. Each model is saved with `save_pretrained` and its config.json read
back, so our config parsing sees exactly what a real checkpoint directory holds (values equal to
defaults are left out).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SLIDING_WINDOW = 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_config(family: str, **changes: Any) -> transformers.PretrainedConfig:
    """The tiny config of `family` (3 layers, hidden 64, vocabulary 128), `changes` on top."""
    if family == "llama":
        return transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": False, **changes})
    if family == "llama_tied":
        return transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True, **changes})
    if family == "mistral":
        return transformers.MistralConfig(
            **{**_COMMON, "sliding_window": SLIDING_WINDOW, **changes}
        )
    if family == "qwen2":
        return transformers.Qwen2Config(**{**_COMMON, **changes})
    if family == "qwen3":
        qwen3 = {"head_dim": 16, "tie_word_embeddings": True}
        return transformers.Qwen3Config(**{**_COMMON, **qwen3, **changes})
    if family == "gemma3":
        gemma3 = dict(
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_theta=10_000.0,
            rope_local_base_freq=100.0,
        )
        return transformers.Gemma3TextConfig(**{**_COMMON, **gemma3, **changes})
    raise KeyError(family)


def build_hf_model(
    family: str,
    path: Path,
    seed: int = 0,
    *,
    std: float | None = 0.1,
    tokenizer: bool = False,
    max_shard_size: str | None = None,
    **changes: Any,
) -> tuple[torch.nn.Module, dict]:
    """A random-weight transformers model of `hf_config(family, **changes)` in fp32 eval mode,
    saved at `path`; returns it and its config.json as saved.

    `std`: every parameter drawn from N(0, std) after seeding `seed` (the default 0.1 is larger
    than the init's 0.02, so that every block visibly moves the logits); None keeps transformers'
    own initialization. `tokenizer`: the packaged default model's tokenizer files are copied
    beside it, so prefixserve loads the directory like a real checkpoint (give
    `vocab_size=default_vocab_size()` then). `max_shard_size`: save in shards of that size."""
    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family, **changes), attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, std)
    save = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **save)
    if tokenizer:
        from prefixserve.model.loader.default_model import ensure_default_model

        default = ensure_default_model()
        for name in TOKENIZER_FILES:
            shutil.copy(default / name, path / name)
    return model, json.loads((path / "config.json").read_text())


def default_vocab_size() -> int:
    """The packaged default model's vocabulary size (what its tokenizer produces)."""
    from prefixserve.model.loader.default_model import ensure_default_model

    return int(transformers.AutoConfig.from_pretrained(ensure_default_model()).vocab_size)


def tiny_llama_dir(path: Path) -> Path:
    """The model the cluster and server-combination tests serve: a 2-layer Llama (hidden 64,
    tied embeddings) with transformers' own initialization (seed 0) and the default model's
    vocabulary and tokenizer, fast to load and run."""
    build_hf_model(
        "llama_tied",
        path,
        std=None,
        tokenizer=True,
        vocab_size=default_vocab_size(),
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=2048,
    )
    return Path(path)


def build_ours(hf_model: torch.nn.Module, config_json: dict, dtype: str = "float32"):
    """Our model of `config_json` with `hf_model`'s weights, and its ModelConfig."""
    from prefixserve.model.loader.hf_config import model_config_from_hf
    from prefixserve.model.models.registry import create_model

    config = model_config_from_hf(config_json, dtype)
    model = create_model(config)
    model.load_weights(hf_model.state_dict().items())
    return model, config


def reference_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids`, [len, vocab] float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.isfinite(ours).all()
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale + 1e-6, f"max abs error {err:.3g} at logit scale {scale:.3g}"
