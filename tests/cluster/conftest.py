"""Fixtures of the cluster tests: a tiny random-weight model with the default model's tokenizer,
and two replicas of it on a local Ray runtime behind the OpenAI server."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from helpers import default_vocab_size, save_with_default_tokenizer

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig


def tiny_model_dir(path: Path) -> Path:
    """A 2-layer Llama with random weights and SmolLM2's tokenizer (fast to load and run)."""
    config = transformers.LlamaConfig(
        vocab_size=default_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    save_with_default_tokenizer(config, path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def replica_config(model: Path, **scheduler: int) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(**scheduler) if scheduler else SchedulerConfig(),
    )
