"""The router's index: which replica holds which prefix, from the replicas' own KV events.

Keys are the router's own. A replica's block hashes chain from its hash seed, which the router
does not trust to match anyone else's; so for each stored block the router computes
`key = H(parent's key || token ids || extra keys)` with the replicas' hash function and its own
root, from the event's token ids and parent chain. The extra keys carry the tenant's cache salt
(first block) and the LoRA adapter, so tenants and adapters stay apart in routing exactly as in
caching. A prompt's keys are computed the same way (`prompt_keys`), and `match` finds, per
replica, how many of its leading blocks that replica holds.

Per replica the index maps the engine's hash to the router's key with a copy count: one hash may
sit in several blocks, and every eviction is its own event. A block whose parent the router has
not seen (a lost batch; a snapshot listing a child whose parent was evicted) waits, bounded, until
the parent arrives.

Batches are numbered per replica epoch. `apply` returns the seq to replay from when it sees a
gap; the caller asks the replica to replay it from its ring, or for a snapshot once the ring has
moved on (`apply_snapshot`). A batch of a newer epoch (the replica restarted) drops what the
index knew of that replica. Routed requests insert their keys optimistically (`insert_pending`),
until events confirm them or `pending_ttl_s` passes.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prefixserve.cluster.messages import (
    EventBatch,
    RegistrationError,
    ReplicaInfo,
    Snapshot,
)
from prefixserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixserve.core.kv_cache.hashing import (
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
)

# The root of the router's key chains (a block at position 0 has no parent).
ROUTER_ROOT = hashlib.sha256(b"prefixserve-router-root").digest()
DEFAULT_MAX_ORPHANS = 4096
DEFAULT_PENDING_TTL_S = 30.0
DEFAULT_MAX_PENDING = 1 << 18


@dataclass(slots=True)
class IndexStats:
    batches: int = 0
    events: int = 0
    duplicates: int = 0  # batches seen before (a replay overlapping a push)
    stale: int = 0  # batches of an older epoch
    gaps: int = 0  # times a batch came after a missing one
    snapshots: int = 0
    orphans: int = 0  # blocks that arrived before their parent
    dropped_orphans: int = 0  # orphans forgotten to keep the bound
    unknown_removals: int = 0  # removals of hashes the index did not hold


@dataclass(slots=True)
class _Replica:
    info: ReplicaInfo
    next_seq: int = 0
    keys: dict[bytes, bytes] = field(default_factory=dict)  # engine hash -> router key
    copies: dict[bytes, int] = field(default_factory=dict)  # engine hash -> blocks holding it
    key_refs: collections.Counter[bytes] = field(default_factory=collections.Counter)
    # parent hash -> blocks waiting for it: (hash, tokens, extra keys, copies)
    orphans: collections.OrderedDict[bytes, list[tuple[Any, ...]]] = field(
        default_factory=collections.OrderedDict
    )
    orphan_parent: dict[bytes, bytes] = field(default_factory=dict)  # orphan hash -> its parent
    num_orphans: int = 0


@dataclass(slots=True)
class PromptView:
    """What the request block hasher reads of a request (hashing.get_request_block_hasher)."""

    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_digest: str | None = None
    prompt_embeds: Any = None
    block_hashes: list[bytes] = field(default_factory=list)


class PrefixIndex:
    """Router keys per replica, kept from event batches; prefix matches of prompts."""

    def __init__(
        self,
        block_size: int,
        hash_algo: str,
        *,
        max_orphans: int = DEFAULT_MAX_ORPHANS,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        get_hash_fn(hash_algo)  # a clear error for an unknown name
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.max_orphans = max_orphans
        self.pending_ttl_s = pending_ttl_s
        self.max_pending = max_pending
        self.seed_fingerprint: str | None = None
        self.stats = IndexStats()
        self._replicas: dict[int, _Replica] = {}
        self._holders: dict[bytes, set[int]] = {}  # router key -> replicas holding it
        self._pending: dict[bytes, dict[int, float]] = {}  # router key -> {replica: expiry}
        self._num_pending = 0
        self._hasher = get_request_block_hasher(block_size, hash_algo, none_hash=ROUTER_ROOT)

    # ------------------------------------------------------------------------ replicas
    def register(self, info: ReplicaInfo) -> None:
        """Add a replica, or take a restarted one's new epoch (forgetting its old blocks).
        Raises RegistrationError when its cache layout or hash seed differs from the others'."""
        if info.block_size != self.block_size or info.hash_algo != self.hash_algo:
            raise RegistrationError(
                f"replica {info.replica_id} caches blocks of {info.block_size} tokens hashed "
                f"with {info.hash_algo}; this router routes {self.block_size}-token blocks "
                f"hashed with {self.hash_algo}"
            )
        others = {
            r.info.seed_fingerprint for rid, r in self._replicas.items() if rid != info.replica_id
        }
        if others and info.seed_fingerprint not in others:
            raise RegistrationError(
                f"replica {info.replica_id} chains its block hashes from another seed "
                f"(fingerprint {info.seed_fingerprint}, the others {sorted(others)}): replicas "
                "that share a KV store must share its seed"
            )
        self.seed_fingerprint = info.seed_fingerprint
        old = self._replicas.get(info.replica_id)
        if old is not None and old.info.epoch == info.epoch:
            return
        self.unregister(info.replica_id)
        self._replicas[info.replica_id] = _Replica(info)

    def unregister(self, replica_id: int) -> None:
        """Forget a replica and every block it held."""
        view = self._replicas.pop(replica_id, None)
        if view is None:
            return
        for key in view.key_refs:
            self._drop_holder(key, replica_id)
        for key in list(self._pending):
            if self._pending[key].pop(replica_id, None) is not None:
                self._num_pending -= 1
                if not self._pending[key]:
                    del self._pending[key]

    @property
    def replica_ids(self) -> list[int]:
        return sorted(self._replicas)

    def epoch(self, replica_id: int) -> int:
        return self._replicas[replica_id].info.epoch

    def next_seq(self, replica_id: int) -> int:
        return self._replicas[replica_id].next_seq

    def num_blocks(self, replica_id: int) -> int:
        """Distinct hashes the index holds for this replica."""
        return len(self._replicas[replica_id].copies)

    # -------------------------------------------------------------------------- events
    def apply(self, batch: EventBatch) -> int | None:
        """Apply one pushed or replayed batch. Returns the seq to replay from when batches are
        missing before this one (nothing is applied then), else None (applied, or dropped as a
        duplicate, a stale epoch or an unknown replica)."""
        view = self._replicas.get(batch.replica_id)
        if view is None:
            return None
        if batch.epoch < view.info.epoch:
            self.stats.stale += 1
            return None
        if batch.epoch > view.info.epoch:
            # Restarted, not re-registered yet: what the old process held is gone.
            info = view.info
            self.unregister(batch.replica_id)
            view = _Replica(_with_epoch(info, batch.epoch))
            self._replicas[batch.replica_id] = view
        if batch.seq < view.next_seq:
            self.stats.duplicates += 1
            return None
        if batch.seq > view.next_seq:
            self.stats.gaps += 1
            return view.next_seq
        self.stats.batches += 1
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                    tokens = event.token_ids[i * size : (i + 1) * size]
                    self._store(view, block_hash, parent, tokens, event.extra_keys[i], 1)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._remove(view, block_hash)
            elif isinstance(event, AllBlocksCleared):
                self._clear(view)
        view.next_seq = batch.seq + 1
        return None

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Replace what the index knows of a replica by its snapshot."""
        view = self._replicas.get(snapshot.replica_id)
        if view is None or snapshot.epoch < view.info.epoch:
            return
        if snapshot.epoch == view.info.epoch and snapshot.next_seq < view.next_seq:
            return  # older than what the index applied already
        self.stats.snapshots += 1
        self.unregister(snapshot.replica_id)
        view = _Replica(_with_epoch(view.info, snapshot.epoch), next_seq=snapshot.next_seq)
        self._replicas[snapshot.replica_id] = view
        for block in snapshot.blocks:
            self._store(
                view,
                block.block_hash,
                block.parent_hash,
                block.token_ids,
                block.extra_keys,
                block.copies,
            )

    # ------------------------------------------------------------------------- prompts
    def prompt_keys(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_digest: str | None = None,
        prompt_embeds: Any = None,
    ) -> list[bytes]:
        """The router keys of a prompt's full blocks (the same extra keys as the engine's).
        `prompt_embeds`: the engine's bits of the embeddings (prompt_embeds.embeds_bits)."""
        view = PromptView(list(token_ids), cache_salt, lora_name, lora_digest, prompt_embeds)
        return self.keys_of(view)

    def keys_of(self, view: PromptView) -> list[bytes]:
        """The router keys of the prompt `view` describes."""
        return list(self._hasher(view))

    def match(self, keys: Sequence[bytes], now: float) -> dict[int, int]:
        """Per replica, how many of the leading `keys` it holds (or was sent, pending)."""
        result: dict[int, int] = {}
        alive = set(self._replicas)
        for i, key in enumerate(keys):
            holders = self._holders.get(key, ())
            pending = self._pending.get(key)
            keep = set()
            for rid in alive:
                if rid in holders or (pending is not None and pending.get(rid, 0.0) > now):
                    keep.add(rid)
                else:
                    result[rid] = i
            alive = keep
            if not alive:
                break
        for rid in alive:
            result[rid] = len(keys)
        return result

    def insert_pending(self, replica_id: int, keys: Iterable[bytes], now: float) -> None:
        """Count `keys` as held by the replica a request was just routed to, until its events
        confirm them or `pending_ttl_s` passes."""
        if replica_id not in self._replicas:
            return
        if self._num_pending >= self.max_pending:
            self._expire_pending(now)
        expiry = now + self.pending_ttl_s
        for key in keys:
            if self._num_pending >= self.max_pending:
                return
            if replica_id in self._holders.get(key, ()):
                continue
            slot = self._pending.setdefault(key, {})
            if replica_id not in slot:
                self._num_pending += 1
            slot[replica_id] = expiry

    # ------------------------------------------------------------------------ internals
    def _store(
        self,
        view: _Replica,
        block_hash: bytes,
        parent: bytes | None,
        tokens: Sequence[int],
        extra: tuple[Any, ...] | None,
        copies: int,
    ) -> None:
        work = [(block_hash, parent, tokens, extra, copies)]
        while work:
            block_hash, parent, tokens, extra, copies = work.pop()
            if block_hash in view.copies:
                view.copies[block_hash] += copies
                continue
            parent_key = ROUTER_ROOT if parent is None else view.keys.get(parent)
            if parent_key is None:
                self._add_orphan(view, parent, (block_hash, tokens, extra, copies))
                continue
            key = hash_block_tokens(self.hash_algo, parent_key, tokens, extra)
            view.keys[block_hash] = key
            view.copies[block_hash] = copies
            view.key_refs[key] += 1
            if view.key_refs[key] == 1:
                self._holders.setdefault(key, set()).add(view.info.replica_id)
                self._confirm_pending(key, view.info.replica_id)
            waiting = view.orphans.pop(block_hash, None)
            if waiting:
                view.num_orphans -= len(waiting)
                for h, *_ in waiting:
                    view.orphan_parent.pop(h, None)
                work.extend((h, block_hash, t, e, c) for h, t, e, c in waiting)

    def _add_orphan(self, view: _Replica, parent: bytes, entry: tuple[Any, ...]) -> None:
        self.stats.orphans += 1
        view.orphans.setdefault(parent, []).append(entry)
        view.orphan_parent[entry[0]] = parent
        view.num_orphans += 1
        while view.num_orphans > self.max_orphans:
            _, dropped = view.orphans.popitem(last=False)
            view.num_orphans -= len(dropped)
            self.stats.dropped_orphans += len(dropped)
            for h, *_ in dropped:
                view.orphan_parent.pop(h, None)

    def _remove(self, view: _Replica, block_hash: bytes) -> None:
        copies = view.copies.get(block_hash)
        if copies is None:
            if not self._remove_orphan(view, block_hash):
                self.stats.unknown_removals += 1
            return
        if copies > 1:
            view.copies[block_hash] = copies - 1
            return
        del view.copies[block_hash]
        key = view.keys.pop(block_hash)
        view.key_refs[key] -= 1
        if view.key_refs[key] <= 0:
            del view.key_refs[key]
            self._drop_holder(key, view.info.replica_id)

    def _remove_orphan(self, view: _Replica, block_hash: bytes) -> bool:
        """Drop one copy of a block still waiting for its parent (evicted before it arrived)."""
        parent = view.orphan_parent.get(block_hash)
        if parent is None:
            return False
        waiting = view.orphans[parent]
        i = next(i for i, entry in enumerate(waiting) if entry[0] == block_hash)
        h, tokens, extra, copies = waiting[i]
        if copies > 1:
            waiting[i] = (h, tokens, extra, copies - 1)
            return True
        del waiting[i]
        view.num_orphans -= 1
        del view.orphan_parent[block_hash]
        if not waiting:
            del view.orphans[parent]
        return True

    def _clear(self, view: _Replica) -> None:
        for key in view.key_refs:
            self._drop_holder(key, view.info.replica_id)
        view.keys.clear()
        view.copies.clear()
        view.key_refs.clear()
        view.orphans.clear()
        view.orphan_parent.clear()
        view.num_orphans = 0

    def _drop_holder(self, key: bytes, replica_id: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[key]

    def _confirm_pending(self, key: bytes, replica_id: int) -> None:
        slot = self._pending.get(key)
        if slot is not None and slot.pop(replica_id, None) is not None:
            self._num_pending -= 1
            if not slot:
                del self._pending[key]

    def _expire_pending(self, now: float) -> None:
        for key in list(self._pending):
            slot = self._pending[key]
            for rid in [rid for rid, expiry in slot.items() if expiry <= now]:
                del slot[rid]
                self._num_pending -= 1
            if not slot:
                del self._pending[key]


def _with_epoch(info: ReplicaInfo, epoch: int) -> ReplicaInfo:
    return replace(info, epoch=epoch)
