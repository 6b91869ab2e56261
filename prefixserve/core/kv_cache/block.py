"""`KVCacheBlock`: one physical block of the KV pool, as the pool, its free queue and the
eviction policies see it (vLLM's `KVCacheBlock` of `kv_cache_utils.py`): its id, references,
the hash it is cached under, and the free queue's intrusive links (`eviction/lru.py`).
"""

from __future__ import annotations


class KVCacheBlock:
    """One physical KV block. Created once by the pool; never copied."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "token_ids",
        "prev_free",
        "next_free",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while cached: the block's hash, its KV-cache group and its token ids (kept to
        # detect hash collisions).
        self.block_hash: bytes | None = None
        self.group_id = -1
        self.token_ids: list[int] | None = None
        # Free-queue links; None when the block is not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        # Nothing else: a policy that keeps more per block (hit counts, chain depths, a segment
        # mark, a heap key) keeps it itself, indexed by block_id (policies.py).

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"
