"""KV cache events: what the block pool stored, evicted or cleared (for external KV-aware routers).

Events are recorded only when the pool is built with events enabled, and drained with
`take_events()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that just became cached, in chain order: one event per contiguous run of a caching
    call, so each block's parent is the block before it (the first's: `parent_block_hash`)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # hash of the block before the first one; None at the start
    token_ids: list[int]  # all token ids of the stored blocks, concatenated
    block_size: int
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None]  # one entry per stored block
    group_idx: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block was evicted (its slot was reused)."""

    block_hashes: list[bytes]
    group_idx: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
