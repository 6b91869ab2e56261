"""The prefix cache's second tier: K/V blocks on local disk, shared by processes, kept on restart.

The RAM block pool (`kv_cache/`) is the first tier. This package is the second: a directory of
files, one block of one KV-cache group each, content-addressed by the block's hash. It is split
like vLLM's KV connector, and this package holds the parts both sides use, torch-free:

- Compatibility (`fingerprint.py`): `model_fingerprint(model_dir)` digests config.json and the
  weights; `store_namespace(fingerprint, dtype, block_size, hash_algo, kv_layout)` names the
  subdirectory, so a store written by another model, dtype, block size, hash or KV layout can never
  be looked up (records also carry their namespace).
- The hash chain's seed (`seed.py`): `load_or_create_seed(root)`, the store's own 32-byte secret
  (0600). NONE_HASH is derived from it so that block hashes are stable across restarts yet not
  guessable; the salts stay in every hash, so tenants stay apart in this tier too.
- The store (`disk_store.py`): `DiskKVStore(root, namespace, capacity_bytes)`; key = (block hash,
  group). `contains` / `count_prefix` are stats only; `get` / `get_into` verify everything
  (`record.py`) and treat any doubt as a miss that removes the file; `put` is atomic. Capacity
  (LRU by atime, over the whole root), expiry (mtime; `sweep_expired`) and the files of other
  processes (`scan.py`) are handled inside.
- Writing (`writer.py`): `BackgroundWriter(store, ...)`, a bounded queue and one thread: `submit`
  never blocks (full => dropped and counted); `flush` at shutdown.

What the engine wires in (not done here):
- Scheduler side (pure Python, every step): after `KVCacheManager.get_computed_blocks`, continue
  the chain on disk: `store.count_prefix(request.block_hashes[num_ram_hits:], group_ids)` (for
  sliding-window groups only the blocks inside the window matter); allocate pool blocks for those
  and carry "load (key, token ids) into block id" in `SchedulerOutput`; count them as computed.
  Choose what to save (blocks the pool evicts, from its events; or write-through when cached),
  skipping blocks of `in_memory` requests and blocks already on disk.
- Worker side (the runner): per load, `store.get_into(key, token_ids, staging)` then copy into the
  KV tensors of the group's layers; a miss (False) must turn into recomputation of that block and
  every later one of the request. Per save, copy the block's K/V out of the pool (the block may be
  reused next step), then `writer.submit(key, token_ids, payload, expires_at)`.
- Start-up: `resolve_store_config(KVStoreConfig(...))` (the record lives in `config.py`),
  `load_or_create_seed(config.dir)` -> NONE_HASH,
  `DiskKVStore(config.dir, store_namespace(...), config.capacity_bytes)`, `BackgroundWriter`;
  log the directory and capacity. Shutdown: `writer.close(timeout)`.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import prefixserve.settings as settings
from prefixserve.config import RETENTION_SECONDS, KVStoreConfig
from prefixserve.kv_store.disk_store import DiskKVStore, DiskStoreStats
from prefixserve.kv_store.fingerprint import KV_LAYOUT_VERSION, model_fingerprint, store_namespace
from prefixserve.kv_store.fs import UnsafeStoreError
from prefixserve.kv_store.lookup import BlockKey, StoreLookup
from prefixserve.kv_store.seed import SeedError, load_or_create_seed
from prefixserve.kv_store.writer import BackgroundWriter, WriterStats

__all__ = [
    "KV_LAYOUT_VERSION",
    "RETENTION_SECONDS",
    "BackgroundWriter",
    "BlockKey",
    "DiskKVStore",
    "DiskStoreStats",
    "KVStoreConfig",
    "SeedError",
    "StoreLookup",
    "UnsafeStoreError",
    "WriterStats",
    "capacity_from_gb",
    "default_capacity_bytes",
    "load_or_create_seed",
    "resolve_store_config",
    "model_fingerprint",
    "store_namespace",
]

GIB = 1 << 30
# The default capacity: a quarter of the free disk space, at most this much.
DEFAULT_MAX_CAPACITY_BYTES = 32 * GIB


def capacity_from_gb(gb: float) -> int:
    """Bytes for `--kv-store-gb` (GiB, as vLLM's `--swap-space`); ValueError unless finite > 0."""
    if isinstance(gb, bool) or not isinstance(gb, int | float) or not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"KV store size must be a positive number of GiB, got {gb!r}")
    return max(1, int(gb * GIB))


def default_capacity_bytes(directory: Path) -> int:
    """A capacity that fits the machine: a quarter of the free space of `directory`'s filesystem
    (or of its nearest existing parent), at most DEFAULT_MAX_CAPACITY_BYTES."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return max(1, min(DEFAULT_MAX_CAPACITY_BYTES, shutil.disk_usage(existing).free // 4))


def resolve_store_config(config: KVStoreConfig) -> KVStoreConfig:
    """`config` with `dir` (`settings.kv_store_root()`) and `capacity_bytes`
    (`default_capacity_bytes`) filled in where it left them None."""
    directory = config.dir if config.dir is not None else settings.kv_store_root()
    capacity = config.capacity_bytes
    if capacity is None:
        capacity = default_capacity_bytes(directory)
    return dataclasses.replace(config, dir=directory, capacity_bytes=capacity)
