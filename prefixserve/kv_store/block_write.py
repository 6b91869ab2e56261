"""`BlockWrite`: one block on its way to a tier below the RAM pool, as one record: its identity
(hash and KV-cache group), its token ids and the hash of the block before it (the checks a
reader makes), its K/V payload and its expiry. The connector makes one per block; the tiers
(`tier.py` `KVTier.submit_store`) and the disk's writer (`writer.py`) pass it on to where it is
written (`DiskKVStore.put`, the shared tier's writer thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixserve.kv_store.lookup import BlockKey


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """One block to write. `payload` is kept until written: pass memory nobody changes (the
    runner's gathered copies). `expires_at`: wall-clock seconds (None: no expiry)."""

    block_hash: bytes
    group: int
    token_ids: Sequence[int]
    payload: bytes | bytearray | memoryview
    expires_at: float | None = None
    parent: bytes = b""  # the hash of the block before it (the chain's seed for a first block)

    @classmethod
    def at(
        cls,
        key: BlockKey,
        token_ids: Sequence[int],
        payload: bytes | bytearray | memoryview,
        expires_at: float | None = None,
        parent: bytes = b"",
    ) -> BlockWrite:
        """The write of block `key` ((block hash, group), as the disk store names it)."""
        block_hash, group = key
        return cls(block_hash, group, token_ids, payload, expires_at, parent)

    @property
    def key(self) -> BlockKey:
        return (self.block_hash, self.group)

    @property
    def nbytes(self) -> int:
        return memoryview(self.payload).nbytes
