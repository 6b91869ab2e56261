"""Rules of the disk tier's configuration (prefixserve/kv_store/__init__.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve import settings
from prefixserve.kv_store import (
    DEFAULT_MAX_CAPACITY_BYTES,
    RETENTION_SECONDS,
    KVStoreConfig,
    capacity_from_gb,
    default_capacity_bytes,
    resolve_store_config,
)


def test_config_defaults_resolve_under_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    config = resolve_store_config(KVStoreConfig())
    assert config.dir == tmp_path / "kv_store" == settings.kv_store_root()
    assert 0 < config.capacity_bytes <= DEFAULT_MAX_CAPACITY_BYTES
    assert config.enabled and config.default_retention == "24h"


def test_config_keeps_what_was_given(tmp_path):
    config = resolve_store_config(
        KVStoreConfig(dir=str(tmp_path), capacity_bytes=1000, enabled=False)
    )
    assert (config.dir, config.capacity_bytes, config.enabled) == (tmp_path, 1000, False)
    assert isinstance(KVStoreConfig(dir="~/x").dir, Path)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be a positive int"),
        ({"capacity_bytes": 1.5}, "capacity_bytes must be a positive int"),
        ({"enabled": 1}, "enabled must be True or False"),
        ({"default_retention": "1h"}, "unknown prompt cache retention '1h'; valid: 'in_memory'"),
        ({"writer_queue_items": 0}, "writer_queue_items"),
        ({"writer_queue_bytes": None}, "writer_queue_bytes"),
        ({"dir": ""}, "dir must be a path"),
    ],
)
def test_config_refuses_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        KVStoreConfig(**kwargs)


def test_retentions_are_openais_and_in_memory_never_reaches_disk():
    assert RETENTION_SECONDS == {"in_memory": None, "24h": 86400.0}


def test_capacity_from_gb_is_gib_and_refuses_nonsense():
    assert capacity_from_gb(2) == 2 << 30
    assert capacity_from_gb(0.5) == 1 << 29
    for bad in (0, -1, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="positive number of GiB"):
            capacity_from_gb(bad)


def test_default_capacity_uses_the_nearest_existing_parent(tmp_path):
    capacity = default_capacity_bytes(tmp_path / "not" / "yet")
    assert 0 < capacity <= DEFAULT_MAX_CAPACITY_BYTES
