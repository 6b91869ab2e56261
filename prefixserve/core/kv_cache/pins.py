"""Pinned prefixes: cached blocks an operator keeps resident in the RAM pool.

A pin holds one reference on each block of a cached prefix (every KV-cache group), exactly as a
running request holds its blocks, so the pool never evicts them: a block with a reference is not
in the free queue. Unpinning drops the references (tail first, like freeing a request), and the
blocks become ordinary cached blocks again. The pinned capacity is bounded in blocks; a pin past it
is refused, naming the numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool


class PinnedPrefixes:
    """Pins by id over one block pool, at most `capacity_blocks` distinct blocks in all."""

    def __init__(self, block_pool: BlockPool, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int):
            raise ValueError(f"capacity_blocks must be an int, got {capacity_blocks!r}")
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.block_pool = block_pool
        self.capacity_blocks = capacity_blocks
        self._pins: dict[str, tuple[list[KVCacheBlock], int]] = {}  # id -> (blocks, tokens)

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by pins (two pins of one prefix share its blocks)."""
        return len(self.holders())

    def holders(self) -> Counter[int]:
        """Block id -> number of pins holding it."""
        counts: Counter[int] = Counter()
        for blocks, _ in self._pins.values():
            counts.update(block.block_id for block in blocks)
        return counts

    def pin(self, pin_id: str, groups: Sequence[Sequence[KVCacheBlock]], num_tokens: int) -> None:
        """Hold `groups`' blocks (a cache hit: one list per KV-cache group) under `pin_id`.

        Raises ValueError for a used id, nothing to pin, or a pin past the capacity (nothing is
        held then)."""
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} exists already")
        blocks = [block for group in groups for block in group if not block.is_null]
        if not blocks:
            raise ValueError("nothing to pin: no block of the prefix is cached")
        held = self.holders()
        new = {block.block_id for block in blocks} - set(held)
        if len(held) + len(new) > self.capacity_blocks:
            raise ValueError(
                f"pinning {len(new)} more KV blocks would pass the pinned capacity: "
                f"{len(held)} of {self.capacity_blocks} blocks are pinned"
            )
        self.block_pool.touch(blocks)
        self._pins[pin_id] = (blocks, num_tokens)

    def unpin(self, pin_id: str) -> bool:
        """Drop a pin; False when there is none of that id."""
        entry = self._pins.pop(pin_id, None)
        if entry is None:
            return False
        self.block_pool.free_blocks(reversed(entry[0]))
        return True

    def clear(self) -> None:
        """Drop every pin."""
        for pin_id in list(self._pins):
            self.unpin(pin_id)

    def describe(self) -> dict[str, dict[str, int]]:
        """pin id -> {"num_tokens", "num_blocks"}."""
        return {
            pin_id: {"num_tokens": tokens, "num_blocks": len(blocks)}
            for pin_id, (blocks, tokens) in self._pins.items()
        }
