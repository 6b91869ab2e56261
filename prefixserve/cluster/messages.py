"""What replicas and the router exchange: registration, numbered event batches, snapshots.

All operator-internal: these records travel between processes of one deployment (Ray object
transfers), never to a tenant. Plain frozen dataclasses of bytes, ints, strings and tuples, so
they pickle compactly and compare by value in tests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from prefixserve.core.kv_cache.events import KVCacheEvent


def seed_fingerprint(none_hash: bytes) -> str:
    """What a replica registers of its hash chain's seed: a digest, never the seed itself."""
    return hashlib.sha256(b"prefixserve-seed:" + none_hash).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """Where a replica's disk store lives: its directory (a path on the replica's host) and the
    namespace its blocks are filed under (kv_store/fingerprint.py)."""

    dir: str
    namespace: str
    # The disk tier's key file (`--kv-store-key-file`; the seed derives from it), else None.
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class RemoteInfo:
    """Where a replica's shared tier lives (`--kv-remote`): the server's URL (never with a
    password), the files its password and its key come from (paths on the replica's host: the
    router reads the same paths on its own; the key gives the hash seed), and the namespace its
    blocks are keyed under."""

    url: str
    namespace: str
    password_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a replica registers with the router (again after every restart)."""

    replica_id: int
    # A new epoch per process start: the router forgets what it knew of an older one.
    epoch: int
    block_size: int
    hash_algo: str
    # A digest of the hash chain's seed (never the seed): replicas that share a disk store must
    # chain hashes from the same seed, or one replica's stored blocks never hit on another.
    seed_fingerprint: str
    num_kv_blocks: int
    max_model_len: int
    store: StoreInfo | None
    # A digest of the engine configuration and threads it was started with: a router that
    # reattaches to running replicas (ray_cluster.py) refuses ones started differently.
    config_digest: str = ""
    # The shared tier it loads from (None without one, or when it could not reach it at its
    # start): the router prices the blocks that tier holds for this replica (remote_probe.py).
    remote: RemoteInfo | None = None


@dataclass(frozen=True, slots=True)
class EventBatch:
    """KV-cache events of one replica, numbered per epoch from 0 without gaps."""

    replica_id: int
    epoch: int
    seq: int
    events: tuple[KVCacheEvent, ...]


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One cached block of a snapshot: what a BlockStored said of it, and its copies."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None
    copies: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every block a replica holds cached, as of just before batch `next_seq` of `epoch`."""

    replica_id: int
    epoch: int
    next_seq: int
    blocks: tuple[CachedBlock, ...]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent in an idle event stream: the router learns of a lost last batch within a second."""

    replica_id: int
    epoch: int
    next_seq: int


class RegistrationError(ValueError):
    """A replica whose cache cannot be routed to together with the others (block size, hash
    function or hash seed differ)."""
