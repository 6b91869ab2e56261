"""Shared helpers of the KV store tests: keys, token ids and payloads derived from an index."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from prefixserve.kv_store.disk_store import DiskKVStore
from prefixserve.kv_store.fingerprint import store_namespace
from prefixserve.kv_store.tier_key import TierKey

NAMESPACE = store_namespace("model-a", "bfloat16", 16, "sha256", "layout-1")
OTHER_NAMESPACE = store_namespace("model-b", "bfloat16", 16, "sha256", "layout-1")
BLOCK_SIZE = 16
# The deployment key of tests that build a shared tier by hand (engines read a key file).
TEST_KEY = TierKey(b"prefixserve tests: a key for the shared tier, not secret", "tests")


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def key(i: int, group: int = 0) -> tuple[bytes, int]:
    return (block_hash(i), group)


def tokens(i: int, variant: int = 0) -> list[int]:
    return [(i * 131 + j * 7 + variant * 1000003) % 50000 for j in range(BLOCK_SIZE)]


def payload(i: int, size: int = 1024, variant: int = 0, group: int = 0) -> bytes:
    seed = hashlib.sha256(f"payload-{i}-{variant}-{group}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class FakeClock:
    """Unix time that moves only when told."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def open_store(
    root: Path, capacity: int = 1 << 30, namespace: str = NAMESPACE, **kwargs
) -> DiskKVStore:
    return DiskKVStore(root, namespace, capacity, **kwargs)


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))
