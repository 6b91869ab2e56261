"""The tiers below the RAM pool: K/V blocks on local disk (shared by processes, kept on restart)
and on a Redis/Valkey server shared by hosts (`remote/`), behind one interface (`tier.py`).

The RAM block pool (`kv_cache/`) is the first tier. The disk is a directory of files, one block
of one KV-cache group each, content-addressed by the block's hash; the shared tier keeps the
same records as values (docs/shared-tier.md). Values on a tier others write carry a MAC under a
key the hosts share (`tier_key.py`). It is split like vLLM's KV connector, and this package
holds the parts both sides use, torch-free:

- Compatibility (`fingerprint.py`): `model_fingerprint(model_dir)` digests config.json and the
  weights; `store_namespace(fingerprint, dtype, block_size, hash_algo, kv_layout)` names the
  subdirectory, so a store written by another model, dtype, block size, hash or KV layout can never
  be looked up (records also carry their namespace).
- The hash chain's seed (`seed.py`): `load_or_create_seed(root)`, the store's own 32-byte secret
  (0600), or a key file's (`tier_key.py`, with the shared tier or `--kv-store-key-file`).
  NONE_HASH is derived from it so that block hashes are stable across restarts yet not
  guessable; the salts stay in every hash, so tenants stay apart in this tier too.
- The store (`disk_store.py`): `DiskKVStore(root, namespace, capacity_bytes)`; key = (block hash,
  group), each record also naming its parent block's hash. `contains` / `count_prefix` are stats
  only; `get` / `get_into` (given the token ids and the parent) verify everything
  (`record.py`) and treat any doubt as a miss that removes the file; `put` is atomic. Capacity
  (LRU by atime, over the whole root), expiry (mtime; `sweep_expired`) and the files of other
  processes (`scan.py`) are handled inside.
- Writing (`writer.py`): `BackgroundWriter(store, ...)`, a bounded queue and one thread: `submit`
  never blocks (full => dropped and counted); `flush` at shutdown.

How the engine wires it in (`connector.py` `KVStoreConnector`, the tiers behind `tier.py`
`KVTier`; docs/cache.md and docs/shared-tier.md tell the whole flow):
- Scheduler side (pure Python, every step): after the RAM pool's hit, `match` continues the chain
  on disk (`count_prefix`) and on the shared tier; the run is read (`load`, or on a thread of its
  own while others run: `start_load`) as (block id, payload) pairs in `SchedulerOutput.kv_loads`,
  counted as computed. Saves are write-through: `blocks_to_save` after each step, skipping blocks
  of `in_memory` requests and blocks already on disk, then `save` to each tier's writer.
- Worker side (the runner): scatters the loaded payloads into the KV tensors before the forward
  pass, and gathers the saved blocks' K/V out of the pool after it (a block may be reused next
  step).
- Start-up: `open_tiers.py` `open_engine_kv_store` (`resolve_store_config`, the seed -> NONE_HASH:
  the shared tier's key, the disk's key or `load_or_create_seed`; `DiskKVStore`,
  `BackgroundWriter`, the shared tier; the connector built over them); shutdown:
  `KVStoreConnector.close`.
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
