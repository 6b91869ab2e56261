"""KV-cache group specs and the cache configuration the manager is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.core.kv_cache.hashing import get_hash_fn


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Layers that attend to every earlier token: a hit is a prefix, searched left to right."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Layers that attend to the last `sliding_window` tokens (the current one included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(
                f"sliding_window must be a positive integer, got {self.sliding_window!r}"
            )


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(slots=True)
class KVCacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` tokens shared by all groups.

    Block 0 is the null block, so `num_blocks - 1` blocks are allocatable. `groups` lists one
    spec per KV-cache group (layers of one attention kind); the order is the order of the
    per-group block tables. `hash_algo` names the block hash function requests should use.
    """

    num_blocks: int
    block_size: int = 16
    groups: list[KVCacheSpec] = field(default_factory=lambda: [FullAttentionSpec()])
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), "
                f"got {self.num_blocks!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not self.groups:
            raise ValueError("groups must hold at least one KV-cache spec")
        for spec in self.groups:
            if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec):
                raise ValueError(
                    f"groups must hold FullAttentionSpec or SlidingWindowSpec, got {spec!r}"
                )
        get_hash_fn(self.hash_algo)
