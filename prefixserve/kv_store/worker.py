"""The worker side of the KV store: one block's K/V as bytes out of the paged cache, and back.

A block's payload is the K and V of every layer for that block, layer by layer (K then V), each
`block_size x num_kv_heads x head_dim` in the cache's dtype, in native byte order: the layout
`kv_layout` names, and the store's namespace includes that name (a cache of another shape or dtype
is another namespace, so its files are never read here). Copies are plain memory copies on the
step thread: on a 2-core AVX2 host, 0.15-0.25 ms per block of SmolLM2-135M (30 layers, 360 KiB)
in batches of 4-32 blocks, against tens of milliseconds to compute the block's 16 tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_layout(kv_caches: KVCaches, kv_cache_dtype: str) -> str:
    """The payload layout of this cache as a string (part of the store namespace): its shape,
    storage dtype and byte order, and the KV dtype it holds (`KVFormat.name`: bf16, float32,
    int8, fp8_e4m3), so blocks of one KV dtype are never served to an engine of another."""
    k_cache = kv_caches[0][0]
    _, block_size, heads, dim = k_cache.shape
    return layout_string(len(kv_caches), block_size, heads, dim, k_cache.dtype, kv_cache_dtype)


def layout_string(
    layers: int, block_size: int, heads: int, row: int, storage: torch.dtype, kv_cache_dtype: str
) -> str:
    """`kv_layout` of a cache of this shape and storage (also for a KV dtype this engine does
    not use: where another engine's blocks of the same prompt would live)."""
    dtype = str(storage).removeprefix("torch.")
    order = sys.byteorder
    return (
        f"layers{layers}-kv-bs{block_size}-heads{heads}-dim{row}-{dtype}-{order}"
        f"-kv_{kv_cache_dtype}/v1"
    )


def block_payload_bytes(kv_caches: KVCaches) -> int:
    """Bytes of one block's payload."""
    k_cache = kv_caches[0][0]
    return 2 * len(kv_caches) * k_cache[0].numel() * k_cache.element_size()


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> list[memoryview]:
    """The payloads of `block_ids`, one read-only memoryview each, over a fresh copy (so the
    cache may be overwritten right after)."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.long)
    per_layer = [torch.stack((k[index], v[index]), dim=1) for k, v in kv_caches]
    # [blocks, layers, 2, block_size, heads, dim], contiguous per block.
    stacked = torch.stack(per_layer, dim=1).contiguous()
    raw = stacked.view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [memoryview(row).toreadonly() for row in raw]


def scatter_blocks(
    kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
) -> None:
    """Write payloads (as gather_blocks made them) into `block_ids` of the cache."""
    if not block_ids:
        return
    k0 = kv_caches[0][0]
    expected = block_payload_bytes(kv_caches)
    for payload in payloads:
        if len(payload) != expected:
            raise ValueError(f"a KV payload has {len(payload)} bytes, expected {expected}")
    # One copy, into a writable buffer viewed in place. (A second, writable copy of a bytes
    # join made up half of a 256-block load after a restart: its page faults, 0.19 s of 0.33 s.)
    raw = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)
    shape = (len(block_ids), len(kv_caches), 2, *k0.shape[1:])
    stacked = raw.view(k0.dtype).reshape(shape)
    index = torch.tensor(block_ids, dtype=torch.long)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, stacked[:, layer, 0])
        v.index_copy_(0, index, stacked[:, layer, 1])
