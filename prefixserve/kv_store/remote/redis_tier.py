"""`RedisTier`: KV blocks on a Redis or Valkey server that every host of a deployment shares.

Keys: `psk:<namespace hex>:<block hash hex>:g<group>`. The namespace is the disk tier's
(fingerprint.py `store_namespace`: model, weights digest, dtype, block size, KV layout), and the
block hash already chains the tenant's salt, so a key names one tenant's block of one model.
Values: the disk tier's record (record.py `encode_record`): identity, the parent block's hash
and the token ids (the collision checks), payload, and a MAC under the deployment's key
(tier_key.py, `--kv-remote-key-file`) where the disk has a checksum; a value that is not exactly
the asked-for block, or whose MAC does not verify (written by someone without the key), is a
miss, counted and deleted.

- `lookup`: how many leading blocks the server holds, one pipelined round trip of EXISTS
  (`RemoteLookup`, remote/lookup.py: the read-only face the cluster router opens too).
- `read_run`: the blocks of a run in one MGET (one round trip), each checked; `load`: one GET.
- `submit_store`: queued for a writer thread (bounded in items and bytes: a full queue drops
  the block and counts it, the step never waits); the writer sends pipelined `SET NX` with the
  retention as TTL, so hosts storing the same block write it once.
The hash chain's seed is the key's (`TierKey.seed`), never read from the server: hosts with
one key file hash alike, and nothing on the server can change how a host hashes.

Faults are misses, never errors: a server that is down, slow (socket timeout), full (OOM
errors), or that holds damaged, truncated, foreign or forged values makes `lookup` return 0 and
`load` None, and counts the cause in `stats`. After a fault the tier is not called for a while
(`RemoteLookup`'s back-off): every call meanwhile is a miss at once (counted `skipped_down`),
so a server that is down costs the step thread one socket timeout per back-off, not one per
request. The call after it reconnects (redis-py's pool opens a new connection): a host started
while the server was down, or that saw it restart, uses it again by itself.
The password, if any, comes from a file (never from the URL or the command line).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.record import RecordError, decode_record, encode_record, pack_tokens
from prefixserve.kv_store.remote.lookup import (
    DEFAULT_RETRY_AFTER_S,
    DEFAULT_SOCKET_TIMEOUT_S,
    KEY_PREFIX,
    MAX_RETRY_AFTER_S,
    RemoteConfigError,
    RemoteLookup,
    check_url,
    read_password,
)
from prefixserve.kv_store.tier import BlockRead
from prefixserve.kv_store.tier_key import TierKey

__all__ = [
    "DEFAULT_RETRY_AFTER_S",
    "DEFAULT_SOCKET_TIMEOUT_S",
    "KEY_PREFIX",
    "MAX_RETRY_AFTER_S",
    "RedisTier",
    "RemoteConfigError",
    "check_url",
    "read_password",
]

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_ITEMS = 1024
# Keys of one MGET of `read_run`: 64 blocks of the default model are ~23 MB a reply.
READ_RUN_KEYS = 64
# The most `close` waits for the queue, then for the writer, in seconds.
CLOSE_TIMEOUT_S = 10.0
DEFAULT_QUEUE_BYTES = 256 * 2**20


@dataclass(slots=True)
class _Store:
    """A queued write: the record is encoded (and MACed) on the writer thread, not the step
    thread that queued it."""

    key: bytes
    write: BlockWrite
    tokens: bytes  # packed on the step thread: a bad token id is the caller's ValueError there
    ttl_s: int | None
    nbytes: int


class RedisTier(RemoteLookup):
    """One namespace of blocks on a Redis/Valkey server (`url`), shared by every host: the
    lookups of `RemoteLookup`, and loads and writes, each value MACed under `key`."""

    def __init__(
        self,
        url: str,
        namespace: str,
        key: TierKey,
        *,
        password_file: str | Path | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        max_queue_items: int = DEFAULT_QUEUE_ITEMS,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        super().__init__(
            url,
            namespace,
            password_file=password_file,
            socket_timeout_s=socket_timeout_s,
            retry_after_s=retry_after_s,
        )
        self._namespace_raw = bytes.fromhex(namespace)
        self.tier_key = key
        self.seed = key.seed  # the hash chain's seed of every host holding this key
        self._max_queue_bytes = max_queue_bytes
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Store | None] = queue.Queue(maxsize=max_queue_items)
        self._writer = threading.Thread(target=self._write_loop, name="kv-remote", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ reads

    name = "remote"  # on the `KVTier` interface (kv_store/tier.py): probe, read, holds, stores

    def read_run(self, blocks: Sequence[BlockRead], group: int) -> tuple[list[bytes], str | None]:
        """The leading `blocks` the server holds, `READ_RUN_KEYS` a MGET (one round trip for
        most prompts; each reply, and the time it holds the server, bounded), each checked as
        `fetch` checks one; the run stops at the first miss, with its reason."""
        payloads: list[bytes] = []
        for start in range(0, len(blocks), READ_RUN_KEYS):
            chunk = blocks[start : start + READ_RUN_KEYS]
            why = self._read_chunk(chunk, group, payloads)
            if why is not None:
                return payloads, why
        return payloads, None

    def _read_chunk(
        self, blocks: Sequence[BlockRead], group: int, payloads: list[bytes]
    ) -> str | None:
        """One MGET of `blocks`, their checked payloads appended to `payloads` up to the first
        miss, whose reason it returns (None: every block read). After a bad value the rest of
        the reply is checked too, and its bad values deleted: a writer who damaged or forged a
        prompt's run has all of it written again by the host that computes it."""
        if not self._callable():
            return "unreachable"
        keys = [self.key(block_hash, group) for block_hash, _, _ in blocks]
        try:
            values = self._client.mget(keys)
        except self._errors as exc:
            self._fault("load", exc)
            return "unreachable"
        self._reached()
        items = list(zip(keys, blocks, values, strict=True))
        for i, (key, (block_hash, token_ids, parent), value) in enumerate(items):
            payload, why = self._checked(key, value, block_hash, group, token_ids, parent)
            if payload is None:
                if why == "bad_value":
                    self._drop_bad(items[i + 1 :], group)
                return why
            payloads.append(payload)
        return None

    def _drop_bad(self, items: Sequence[tuple[bytes, BlockRead, bytes | None]], group: int) -> None:
        """Check values read but not used (after a bad one), deleting and counting the bad."""
        for key, (block_hash, token_ids, parent), value in items:
            if value is not None:
                self._checked(key, value, block_hash, group, token_ids, parent, count_hit=False)

    def holds(self, block_hash: bytes, group: int) -> bool:
        """False: a write of a block the server holds is deduplicated there (`SET NX`)."""
        return False

    def load(
        self, block_hash: bytes, group: int, token_ids: Sequence[int], parent: bytes = b""
    ) -> bytes | None:
        """The block's payload, checked against its identity, tokens and parent; None on a miss
        of any cause (counted in `stats`)."""
        return self.fetch(block_hash, group, token_ids, parent)[0]

    def fetch(
        self, block_hash: bytes, group: int, token_ids: Sequence[int], parent: bytes = b""
    ) -> tuple[bytes | None, str | None]:
        """`load`, and why it missed: "absent" (not held, or aged out since the lookup),
        "unreachable" (a fault) or "bad_value" (damaged, truncated, foreign, other tokens, a MAC
        that does not verify: the value is deleted, so that the next host to compute the block
        writes it again)."""
        key = self.key(block_hash, group)
        if not self._callable():
            return None, "unreachable"
        try:
            value = self._client.get(key)
        except self._errors as exc:
            self._fault("load", exc)
            return None, "unreachable"
        self._reached()
        return self._checked(key, value, block_hash, group, token_ids, parent)

    def _checked(
        self,
        key: bytes,
        value: bytes | None,
        block_hash: bytes,
        group: int,
        token_ids: Sequence[int],
        parent: bytes = b"",
        count_hit: bool = True,
    ) -> tuple[bytes | None, str | None]:
        """The payload of a value read at `key`, or (None, why) as `fetch` says (a value that
        fails its checks is deleted); a good one counts as a hit unless `count_hit` is False."""
        if value is None:
            self.stats["miss_absent"] += 1
            return None, "absent"
        try:
            payload = decode_record(
                value,
                self._namespace_raw,
                block_hash,
                group,
                pack_tokens(token_ids),
                parent,
                self.tier_key,
            )
        except RecordError as exc:
            self.stats[f"miss_{exc.kind}"] += 1
            self._drop(key)
            return None, "bad_value"
        self.stats["hits"] += count_hit
        return payload, None

    # ------------------------------------------------------------------ writes

    def submit_store(self, write: BlockWrite) -> bool:
        """Queue `write` for the writer, its key's TTL the seconds left until its `expires_at`
        (wall clock; None: none); False (counted `dropped`) when the queue is full. The writer
        keeps a reference to its payload until it is sent: pass memory nobody changes (the
        runner's gathered copies, which the disk writer holds too)."""
        nbytes, tokens = write.nbytes, pack_tokens(write.token_ids)
        with self._lock:
            if self._queued_bytes + nbytes > self._max_queue_bytes:
                self.stats["dropped"] += 1
                return False
            self._queued_bytes += nbytes
        expires_at = write.expires_at
        ttl = None if expires_at is None else max(1, int(expires_at - time.time()))
        item = _Store(self.key(write.block_hash, write.group), write, tokens, ttl, nbytes)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._queued_bytes -= nbytes
            self.stats["dropped"] += 1
            return False
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has sent every queued block; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _write_loop(self) -> None:
        """Send what is queued, up to 64 blocks a pipeline, until `close` queues None."""
        stop = False
        while not stop:
            item = self._queue.get()
            taken = 1
            batch = [] if item is None else [item]
            stop = item is None
            while not stop and len(batch) < 64:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                taken += 1
                if nxt is None:
                    stop = True
                else:
                    batch.append(nxt)
            if batch:
                self._send(batch)
            for _ in range(taken):
                self._queue.task_done()

    def _send(self, batch: list[_Store]) -> None:
        if not self._callable():
            self.stats["store_failed"] += len(batch)
            written = []
        else:
            written = self._send_pipeline(batch)
        for result in written:
            if isinstance(result, Exception):
                self.stats["store_failed"] += 1  # e.g. OOM: maxmemory without an eviction policy
            elif result:
                self.stats["stored"] += 1
            else:
                self.stats["store_deduplicated"] += 1  # another host wrote it first
        with self._lock:
            self._queued_bytes -= sum(item.nbytes for item in batch)

    def _send_pipeline(self, batch: list[_Store]) -> list:
        """The results of one pipeline of `SET NX` for `batch` ([] after a fault, counted)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for item in batch:
                value = encode_record(
                    self._namespace_raw,
                    item.write.block_hash,
                    item.write.group,
                    item.tokens,
                    item.write.payload,
                    item.write.parent,
                    self.tier_key,
                )
                pipe.set(item.key, value, nx=True, ex=item.ttl_s)
            written = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            self._fault("store", exc)
            self.stats["store_failed"] += len(batch)
            return []
        self._reached()
        return written

    # ------------------------------------------------------------------ lifecycle

    def retain(self, blocks: Sequence[BlockRead], group: int, expires_at: float | None) -> int:
        """One pipeline: each held key's TTL set to the seconds left until `expires_at`, or
        removed (None: kept until the server's eviction, a pinned prefix); how many were held
        (0 after a fault, counted)."""
        if not blocks or not self._callable():
            return 0
        ttl = None if expires_at is None else max(1, int(expires_at - time.time()))
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash, _, _ in blocks:
                key = self.key(block_hash, group)
                pipe.exists(key)
                if ttl is None:
                    pipe.persist(key)
                else:
                    pipe.expire(key, ttl)
            results = pipe.execute()
        except self._errors as exc:
            self._fault("retain", exc)
            return 0
        self._reached()
        return sum(1 for held in results[::2] if held)

    def metrics(self) -> dict[str, int]:
        """Its counters as the engine's metrics name them: blocks stored, writes dropped by the
        full queue or failed (a fault, a full server), faults of its calls, values that were
        damaged, foreign or forged (a MAC that does not verify), and whether its latest call
        reached the server (1 or 0)."""
        stats = self.stats
        return {
            "kv_remote_stored_blocks": stats["stored"],
            "kv_remote_dropped_writes": stats["dropped"] + stats["store_failed"],
            "kv_remote_faults": sum(v for k, v in stats.items() if k.startswith("fault_")),
            "kv_remote_bad_values": (
                stats["miss_corrupt"] + stats["miss_foreign"] + stats["miss_unauthenticated"]
            ),
            "kv_remote_connected": int(self.connected),
        }

    def clear(self) -> int:
        """A prefix-cache reset forgets this host's tiers, not this one: other hosts use it."""
        return 0

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """Stop the writer after what is queued (up to `timeout` seconds for each of the
        queue and the writer, never more than `CLOSE_TIMEOUT_S`: a writer stuck on a dead
        server is left behind, a daemon thread), and close the connections; False when the
        writer did not finish in time."""
        wait = CLOSE_TIMEOUT_S if timeout is None else min(timeout, CLOSE_TIMEOUT_S)
        try:
            self._queue.put(None, timeout=wait)
        except queue.Full:
            pass
        self._writer.join(timeout=wait)
        super().close()
        return not self._writer.is_alive()

    def _drop(self, key: bytes) -> None:
        """Delete a value that failed its checks (a fault here is only counted)."""
        try:
            self._client.delete(key)
        except self._errors as exc:
            self._fault("delete", exc)
