"""Pricing store-resident blocks: the router's read-only view of the replicas' shared disk store.

Replicas on one host may share one persistent store directory (`--kv-store-dir`): a prefix one
replica computed and wrote there is loaded, not recomputed, by another. The policy counts such
blocks as cheaper than uncached and dearer than resident (policy.STORE_COST), so the router must
know which of a prompt's blocks the store holds. It asks the store itself: the store's files are
named by the engine's block hashes, which chain from a seed derived from the store's secret; the
router's process reads that secret (it runs as the same user on the same host), chains a prompt's
hashes from it exactly as a replica would (extra keys included: tenants' salts stay apart), and
stats the files, stopping at the first miss (kv_store/lookup.py: no reads, nothing written).

`open_store_probe(infos, ...)` returns None, with the reason logged, whenever this cannot be
exact: replicas without a store, replicas on different stores, a store directory this host
cannot see (replicas on other hosts), or a seed whose fingerprint differs from the replicas'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from prefixserve.cluster.index import PromptView
from prefixserve.cluster.messages import ReplicaInfo, seed_fingerprint
from prefixserve.core.kv_cache.hashing import get_request_block_hasher, none_hash_from_secret
from prefixserve.kv_store.lookup import StoreLookup
from prefixserve.kv_store.seed import SEED_FILE, load_or_create_seed
from prefixserve.kv_store.tier import GROUP
from prefixserve.kv_store.tier_key import TierKey

logger = logging.getLogger(__name__)


class StoreRun:
    """One prompt's blocks as the store names them; `count_from(first)`: how many blocks from
    block `first` on have a live file, contiguous (what a replica holding the first `first` in
    RAM would load: the engine's connector counts from its RAM hit the same way). Memoized per
    `first`, so replicas at the same point cost one lookup."""

    def __init__(self, lookup: StoreLookup, hashes: list[bytes]):
        self._lookup = lookup
        self._hashes = hashes
        self._counts: dict[int, int] = {}

    def count_from(self, first: int) -> int:
        if first not in self._counts:
            self._counts[first] = self._lookup.count_prefix(self._hashes[first:], (GROUP,))
        return self._counts[first]


class SharedStoreProbe:
    """A prompt's blocks in the shared store (a router.StoreProbe)."""

    def __init__(self, lookup: StoreLookup, block_size: int, hash_algo: str, none_hash: bytes):
        self.lookup = lookup
        self._hasher = get_request_block_hasher(block_size, hash_algo, none_hash=none_hash)

    def __call__(self, view: PromptView) -> StoreRun:
        return StoreRun(self.lookup, list(self._hasher(view)))


def _store_secret(root: str, key_file: str | None) -> bytes:
    """The replicas' chain seed for the store at `root`: its key's, else its seed file's;
    OSError or ValueError (a key file that cannot be used) when it cannot be read."""
    if key_file is None:
        return load_or_create_seed(Path(root))
    return TierKey.from_file(key_file, "--kv-store-key-file").seed


def open_store_probe(
    infos: Sequence[ReplicaInfo],
    block_size: int,
    hash_algo: str,
    *,
    none_hash: bytes | None = None,
) -> SharedStoreProbe | None:
    """A probe of the one store every replica shares, or None (logged). `none_hash`: the
    replicas' chain seed when it is not the store's own (a shared tier across hosts gives them
    its seed, remote_probe.py); else the store's seed file is read."""
    stores = {info.store for info in infos}
    if not infos or None in stores:
        return None  # no store, or not on every replica: nothing to share
    if len(stores) > 1:
        logger.info("store-aware routing off: the replicas use %d different stores", len(stores))
        return None
    (store,) = stores
    assert store is not None
    seed_path = Path(store.dir) / SEED_FILE
    if not (seed_path.is_file() or (Path(store.dir) / store.namespace).is_dir()):
        logger.info(
            "store-aware routing off: %s is not visible from the router's host (replicas on "
            "other hosts keep their own stores)",
            store.dir,
        )
        return None
    if none_hash is None:
        try:
            secret = _store_secret(store.dir, store.key_file)
        except (OSError, ValueError) as exc:
            logger.warning("store-aware routing off: cannot read the store's seed (%s)", exc)
            return None
        none_hash = none_hash_from_secret(secret, hash_algo)
    fingerprints = {info.seed_fingerprint for info in infos}
    if fingerprints != {seed_fingerprint(none_hash)}:
        logger.warning(
            "store-aware routing off: %s holds another seed than the replicas chain from "
            "(a directory of the same name on another host?)",
            store.dir,
        )
        return None
    logger.info("store-aware routing on: the replicas share the store %s", store.dir)
    return SharedStoreProbe(
        StoreLookup(store.dir, store.namespace), block_size, hash_algo, none_hash
    )
