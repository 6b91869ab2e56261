"""The cluster tests' engine config of a replica over a model directory."""

from __future__ import annotations

from pathlib import Path

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig


def replica_config(model: Path, **scheduler: int) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(**scheduler) if scheduler else SchedulerConfig(),
    )
