"""Pricing blocks on the shared tier: the router's read-only view of the replicas' Redis/Valkey.

Replicas started with `--kv-remote` load from one server the blocks any host computed
(kv_store/remote/). The policy counts such blocks as it counts a shared disk store's: cheaper
than computing them, dearer than holding them (policy.STORE_COST). So the router asks the
server, as store_probe.py asks the disk: the keys are the engines' block hashes, chained from
the seed of the deployment's key file (kv_store/tier_key.py, `--kv-remote-key-file`: the router
reads the replicas' path on its own host, as it does the password file), checks that its
fingerprint is the replicas', chains a prompt's hashes from it as a replica would (salts and
adapters included: tenants stay apart), and asks which of them the server holds with one
pipelined EXISTS (`RemoteLookup.held`), nothing read or written.

Faults are misses: a server that is down or slow (past `ROUTER_SOCKET_TIMEOUT_S`) prices
nothing, and the lookup's back-off spares the router a timeout per request. Bounded: one round
trip per routed prompt, of at most `MAX_PROBED_BLOCKS` keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from prefixserve.cluster.index import PromptView
from prefixserve.cluster.messages import RemoteInfo, ReplicaInfo, seed_fingerprint
from prefixserve.core.kv_cache.hashing import get_request_block_hasher, none_hash_from_secret
from prefixserve.kv_store.remote.lookup import RemoteLookup, redacted_url
from prefixserve.kv_store.tier import GROUP
from prefixserve.kv_store.tier_key import TierKey

logger = logging.getLogger(__name__)

# Keys one lookup asks for at most (a prompt's loadable blocks beyond it are priced as misses).
MAX_PROBED_BLOCKS = 1024
# Seconds a routing decision waits for the server at most before it routes without it.
ROUTER_SOCKET_TIMEOUT_S = 0.1


class RemoteRun:
    """One prompt's loadable blocks as the server holds them, asked once (at the first
    `count_from`); `count_from(first)`: how many blocks from block `first` on it holds,
    contiguous (what a replica holding the first `first` would load: its connector continues
    from its RAM and disk hits the same way)."""

    def __init__(self, lookup: RemoteLookup | None, hashes: list[bytes]):
        self._lookup = lookup
        self._hashes = hashes
        self._held: list[bool] | None = None

    def count_from(self, first: int) -> int:
        if self._held is None:
            self._held = [] if self._lookup is None else self._lookup.held(self._hashes, GROUP)[0]
        count = 0
        for found in self._held[first:]:
            if not found:
                break
            count += 1
        return count


class SharedTierProbe:
    """A prompt's blocks on the replicas' shared tier `info` (a router.RemoteProbe), hashed
    from `none_hash` (the seed of their key)."""

    def __init__(
        self,
        lookup: RemoteLookup,
        info: RemoteInfo,
        block_size: int,
        hash_algo: str,
        none_hash: bytes,
    ) -> None:
        self.lookup = lookup
        self.info = info
        self.none_hash = none_hash
        self.block_size = block_size
        self._hasher: Callable[[Any], list[bytes]] = get_request_block_hasher(
            block_size, hash_algo, none_hash=none_hash
        )

    def __call__(self, view: PromptView) -> RemoteRun:
        loadable = (len(view.all_token_ids) - 1) // self.block_size
        hashes = self._hasher(view)[: min(loadable, MAX_PROBED_BLOCKS)]
        return RemoteRun(self.lookup, hashes)

    def close(self) -> None:
        self.lookup.close()


def open_remote_probe(
    infos: Sequence[ReplicaInfo], block_size: int, hash_algo: str
) -> SharedTierProbe | None:
    """A probe of the shared tier the replicas use, or None (logged) when none uses one, they
    use different ones, or the router cannot open it (a password or key file it cannot read,
    a key whose seed is not the replicas'). A server that is down now is not a reason: the
    probe prices nothing until it answers."""
    remotes = {info.remote for info in infos if info.remote is not None}
    if not remotes:
        return None
    if len(remotes) > 1:
        logger.info("remote-aware routing off: the replicas use %d shared tiers", len(remotes))
        return None
    (remote,) = remotes
    fingerprints = {info.seed_fingerprint for info in infos if info.remote is not None}
    if len(fingerprints) != 1:
        return None  # the index refuses such replicas; nothing to price meanwhile
    try:
        none_hash = _replicas_none_hash(remote, hash_algo, fingerprints.pop())
        lookup = RemoteLookup(
            remote.url,
            remote.namespace,
            password_file=remote.password_file,
            socket_timeout_s=ROUTER_SOCKET_TIMEOUT_S,
        )
    except (ValueError, OSError) as exc:
        logger.warning(
            "remote-aware routing off: cannot open %s (%s)", redacted_url(remote.url), exc
        )
        return None
    logger.info("remote-aware routing on: the replicas share %s", redacted_url(remote.url))
    return SharedTierProbe(lookup, remote, block_size, hash_algo, none_hash)


def _replicas_none_hash(remote: RemoteInfo, hash_algo: str, fingerprint: str) -> bytes:
    """The replicas' chain seed, from their key file as this host reads it; ValueError when
    there is none or its seed is not the replicas' (another file at that path here)."""
    if remote.key_file is None:
        raise ValueError("the replicas name no key file")
    none_hash = none_hash_from_secret(
        TierKey.from_file(remote.key_file, "--kv-remote-key-file").seed, hash_algo
    )
    if seed_fingerprint(none_hash) != fingerprint:
        raise ValueError(
            f"the key file {remote.key_file} on the router's host gives another hash seed than "
            "the replicas chain from"
        )
    return none_hash
