"""Blocks as one replica's engine stores them, for the router's index tests: its block hashes
(under the engine's own seed, which the router must not need) and the BlockStored event."""

from __future__ import annotations

from prefixserve.core.kv_cache.events import BlockStored
from prefixserve.core.kv_cache.hashing import hash_block_tokens

BS = 4


def engine_hashes(tokens, seed=b"engine-seed", salt=None):
    """What one replica's engine would hash: its own seed (the router must not need it)."""
    hashes, parent = [], seed
    for i in range(len(tokens) // BS):
        extra = (salt,) if salt is not None and i == 0 else None
        parent = hash_block_tokens("sha256", parent, tokens[i * BS : (i + 1) * BS], extra)
        hashes.append(parent)
    return hashes


def stored(tokens, first=0, count=None, seed=b"engine-seed", salt=None):
    hashes = engine_hashes(tokens, seed, salt)
    count = len(hashes) - first if count is None else count
    return BlockStored(
        block_hashes=hashes[first : first + count],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tokens[first * BS : (first + count) * BS],
        block_size=BS,
        lora_name=None,
        extra_keys=[
            (salt,) if salt is not None and i == 0 else None for i in range(first, first + count)
        ],
        group_idx=0,
    )
