"""Opening the tiers below the RAM pool for an engine: `open_engine_kv_store` builds the disk
tier (`DiskKVStore` and its `BackgroundWriter`), the shared tier (`RedisTier`), or both, for the
model's namespace, derives the hash chain's seed (the shared tier's key, else the disk's key,
else the disk's seed file) and returns the `KVStoreConnector` built over them through its
constructor, with the seed's NONE_HASH. The connector (`connector.py`) decides; this module only
builds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prefixserve.core.kv_cache.hashing import none_hash_from_secret
from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec
from prefixserve.kv_store import resolve_store_config
from prefixserve.kv_store.connector import KVStoreConnector
from prefixserve.kv_store.disk_store import DiskKVStore
from prefixserve.kv_store.fingerprint import model_fingerprint, store_namespace
from prefixserve.kv_store.lookup import StoreLookup
from prefixserve.kv_store.remote.lookup import redacted_url
from prefixserve.kv_store.remote.redis_tier import RedisTier
from prefixserve.kv_store.seed import load_or_create_seed
from prefixserve.kv_store.tier_key import TierKey
from prefixserve.kv_store.writer import BackgroundWriter

if TYPE_CHECKING:
    from prefixserve.config import EngineConfig, KVStoreConfig

logger = logging.getLogger(__name__)


def open_engine_kv_store(
    config: EngineConfig,
    model_dir: str | Path,
    groups: Sequence[KVCacheSpec],
    kv_layout: str,
    numerics: str = "",
    other_layouts: dict[str, str] | None = None,
) -> tuple[KVStoreConnector | None, bytes | None]:
    """The tiers `config.kv_store` asks for (the disk, the shared tier, or both), opened for
    this model and cache layout with their writers started, and the hash chain's NONE_HASH:
    from the shared tier's key when there is one (so the hosts of a deployment agree), else
    from the disk tier's key, else from the disk store's secret seed file (so a restarted
    process hits what its predecessor stored); (None, None) when the config has no tier or the
    model cannot use one. A shared tier that cannot be reached now is used once it answers.
    Raises ValueError / OSError (UnsafeStoreError for a directory others can reach,
    TierKeyError for a key file that cannot be used). `numerics`: the runner's name for how its
    K/V are computed where that changes their bits (`ModelRunner.kv_numerics`).
    `other_layouts`: the layouts of the other KV dtypes by name, each with its own numerics,
    whose namespaces a cache report looks in, on the disk and the shared tier
    (`KVStoreConnector.other_kv_dtype`)."""
    store_config = config.kv_store
    if store_config is None or not (store_config.enabled or store_config.remote_url):
        return None, None
    cache = config.cache
    if not _tiers_serve(config, groups):
        return None, None
    # Batch-invariant engines compute K/V on other paths (other roundings): their blocks live
    # apart, or a hit would break the bit-for-bit promise.
    fingerprint = model_fingerprint(model_dir)

    def namespace_of(layout: str) -> str:
        return store_namespace(
            fingerprint, config.dtype, cache.block_size, cache.prefix_caching_hash_algo, layout
        )

    namespace = namespace_of(kv_layout + numerics)
    store, writer, seed = None, None, None
    if store_config.enabled:
        store_config = resolve_store_config(store_config)
        store, writer, seed = _open_disk(store_config, namespace)
    remote = _open_remote(store_config, namespace)
    if remote is not None:
        seed = remote.seed  # the hosts sharing the tier hash alike: the seed of their key
    assert seed is not None
    layouts = (other_layouts or {}).items()
    other_dtypes, other_remote = {}, {}
    if store_config.dir is not None and store is not None:
        other_dtypes = {n: StoreLookup(store_config.dir, namespace_of(la)) for n, la in layouts}
    if remote is not None:
        other_remote = {n: remote.sibling(namespace_of(la)) for n, la in layouts}
    none_hash = none_hash_from_secret(seed, cache.prefix_caching_hash_algo)
    connector = KVStoreConnector(
        store,
        writer,
        cache.block_size,
        store_config.default_retention,
        remote=remote,
        overlap_loads=store_config.overlap_loads,
        root_parent=none_hash,  # a first block's parent: the chain's seed
        other_dtypes=other_dtypes,
        other_remote_dtypes=other_remote,
    )
    return connector, none_hash


def _tiers_serve(config: EngineConfig, groups: Sequence[KVCacheSpec]) -> bool:
    """Whether this engine can use a tier below the RAM pool (logged when not): prefix caching
    on, full-attention layers only."""
    if not config.cache.enable_prefix_caching:
        logger.info("KV store off: prefix caching is off")
        return False
    if any(not isinstance(spec, FullAttentionSpec) for spec in groups):
        logger.warning(
            "KV store off: it serves full-attention models only (this model has "
            "sliding-window layers)"
        )
        return False
    return True


def _open_disk(
    store_config: KVStoreConfig, namespace: str
) -> tuple[DiskKVStore, BackgroundWriter, bytes]:
    """The disk tier of a resolved `store_config` in `namespace`, its writer started, and the
    hash chain's seed: its key's (`key_file`: records MACed) or the store's secret seed file."""
    assert store_config.dir is not None and store_config.capacity_bytes is not None
    key = None
    if store_config.key_file is not None:
        key = TierKey.from_file(store_config.key_file, "--kv-store-key-file")
    secret = load_or_create_seed(store_config.dir) if key is None else key.seed
    store = DiskKVStore(store_config.dir, namespace, store_config.capacity_bytes, key=key)
    writer = BackgroundWriter(
        store,
        max_queue_bytes=store_config.writer_queue_bytes,
        max_queue_items=store_config.writer_queue_items,
    )
    logger.info(
        "KV store: %s (namespace %s), capacity %.2f GiB, %.2f GiB in use; shared with every "
        "process of this user that opens it (a prefix-cache reset clears this namespace; "
        "--no-kv-store / enable_kv_store=False runs without it)",
        store.root,
        namespace,
        store.capacity_bytes / 2**30,
        store.total_bytes / 2**30,
    )
    return store, writer, secret


def _open_remote(store_config: KVStoreConfig, namespace: str) -> RedisTier | None:
    """The shared tier `store_config.remote_url` names, its values MACed under the key of
    `remote_key_file`, or None without one. A server that cannot be reached (or refuses the
    password) now is logged; the tier is used once it answers (its lookups back off meanwhile)."""
    if store_config.remote_url is None:
        return None
    assert store_config.remote_key_file is not None  # KVStoreConfig requires it with a URL
    key = TierKey.from_file(store_config.remote_key_file, "--kv-remote-key-file")
    remote = RedisTier(
        store_config.remote_url,
        namespace,
        key,
        password_file=store_config.remote_password_file,
    )
    answers = remote.ping()
    logger.log(
        logging.INFO if answers else logging.WARNING,
        "KV remote: %s (namespace %s), shared by every host with the same key: %s",
        redacted_url(store_config.remote_url),
        namespace,
        "connected" if answers else f"not answering ({dict(remote.stats)}); used once it answers",
    )
    return remote
