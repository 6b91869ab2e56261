"""Block hashing: hash functions, the NONE_HASH seed, extra keys and the incremental request hasher.

A full block's hash chains its parent's hash, its own token ids and its extra keys:

    block_hash = H(parent_hash || tokens as little-endian int32 [|| 0x01 || extra keys])

The extra-keys part is absent when a block has none (the parent and token parts have a fixed length
for a given hash function and block size, so the two forms cannot be confused). Everything that
enters H is serialized canonically (fixed-width little-endian integers, tagged and length-prefixed
values), never pickled, so equal inputs give equal hashes on every machine and
Python version. The first block's parent is NONE_HASH, a per-process seed that is derived from
PYTHONHASHSEED when it is set (hashes are then reproducible across processes) and random otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from prefixserve.settings import python_hash_seed

if TYPE_CHECKING:
    from prefixserve.core.request import Request

BlockHash = bytes
HashFn = Callable[[bytes], bytes]
# Extra keys of one block: a tuple of str / int / bytes / tuples of them, or None.
ExtraKeys = tuple[Any, ...] | None

# Length prefix of encoded extra-key values and tuples.
_COUNT = struct.Struct("<I")
_HAS_EXTRA = b"\x01"


def _sha256(data: bytes) -> bytes:
    """SHA-256 digest (32 bytes)."""
    return hashlib.sha256(data).digest()


_HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
}


HASH_ALGOS: tuple[str, ...] = tuple(_HASH_FUNCTIONS)


def get_hash_fn(name: str) -> HashFn:
    """Return the hash function called `name` ("sha256" or "xxhash", i.e. xxh3-128).

    Raises ValueError naming the valid choices for an unknown name.
    """
    try:
        return _HASH_FUNCTIONS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(_HASH_FUNCTIONS))
        raise ValueError(f"unknown prefix-cache hash function {name!r}; valid: {valid}") from None


def _resolve(hash_fn: str | HashFn) -> HashFn:
    """A hash function given by name or as a callable."""
    return get_hash_fn(hash_fn) if isinstance(hash_fn, str) else hash_fn


NONE_HASH: BlockHash = b""


def init_none_hash(hash_fn: str | HashFn = "sha256") -> BlockHash:
    """Set (and return) NONE_HASH, the parent hash of every request's first block.

    Derived from PYTHONHASHSEED when that is set, so separate processes agree on every block hash;
    random otherwise. Call it before any request is hashed (module import calls it with sha256).
    """
    global NONE_HASH
    fn = _resolve(hash_fn)
    seed = python_hash_seed()
    if seed is None:
        NONE_HASH = fn(os.urandom(32))  # a digest, so it is as long as every other parent
    else:
        NONE_HASH = fn(b"prefixserve-none-hash:" + seed.encode())
    return NONE_HASH


init_none_hash()


# ---------------------------------------------------------------------------- serialization


def _encode(value: Any, out: bytearray) -> None:
    """Append a canonical, unambiguous encoding of `value` to `out`."""
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out += b"I" + _COUNT.pack(len(raw)) + raw
    elif isinstance(value, str):
        # surrogatepass: a lone surrogate (which JSON can carry) still encodes, injectively,
        # instead of raising inside a step; valid text encodes exactly as plain UTF-8.
        raw = value.encode("utf-8", "surrogatepass")
        out += b"S" + _COUNT.pack(len(raw)) + raw
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out += b"B" + _COUNT.pack(len(raw)) + raw
    elif isinstance(value, tuple | list):
        out += b"L" + _COUNT.pack(len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot hash an extra key of type {type(value).__name__}: {value!r}")


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """Canonical bytes of a block's extra keys (empty when there are none)."""
    if extra_keys is None:
        return b""
    out = bytearray(_HAS_EXTRA)
    _encode(extra_keys, out)
    return bytes(out)


# Token ids are serialized as little-endian int32: every vocabulary fits, and 4 bytes keep a
# 16-token block plus its parent within two SHA-256 compression rounds.
@functools.lru_cache(maxsize=256)
def _token_struct(num_tokens: int) -> struct.Struct:
    """The compiled struct packing `num_tokens` token ids."""
    return struct.Struct(f"<{num_tokens}i")


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (struct packs ~4x faster than array(list))."""
    try:
        return _token_struct(len(token_ids)).pack(*token_ids)
    except struct.error:
        raise ValueError("token ids must be integers that fit in a signed 32-bit int") from None


def hash_block_tokens(
    hash_fn: str | HashFn,
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """Hash one block: its parent's hash (NONE_HASH when None), its token ids, its extra keys."""
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    return _resolve(hash_fn)(parent + _pack_tokens(token_ids) + encode_extra_keys(extra_keys))


# ---------------------------------------------------------------------------- extra keys


def generate_block_extra_keys(
    request: Request, start: int, end: int, hash_fn: str | HashFn = "sha256"
) -> ExtraKeys:
    """Extra keys of the block covering token positions [start, end) of `request`, or None.

    In order: the LoRA adapter name (and the digest of its files, when the request has one);
    the cache salt (first block only); a digest of the block's prompt
    embeddings (only for positions inside the prompt, when the request carries embeddings).
    """
    keys: list[Any] = []
    if request.lora_name is not None:
        keys.append(request.lora_name)
        if request.lora_digest is not None:
            keys.append(request.lora_digest)
    if start == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    embeds = request.prompt_embeds
    if embeds is not None:
        stop = min(end, len(embeds))
        if start < stop:
            keys.append(_resolve(hash_fn)(embeds[start:stop].tobytes()))
    return tuple(keys) if keys else None


# ---------------------------------------------------------------------------- request hasher


def none_hash_from_secret(secret: bytes, hash_fn: str | HashFn = "sha256") -> BlockHash:
    """A NONE_HASH derived from a secret (a persistent KV store's seed): stable across the
    processes that share the secret, unguessable to everyone else."""
    return _resolve(hash_fn)(b"prefixserve-store-none-hash:" + secret)


def get_request_block_hasher(
    block_size: int, hash_fn: str | HashFn = "sha256", none_hash: BlockHash | None = None
) -> Callable[[Request], list[BlockHash]]:
    """Return the incremental hasher a Request calls on creation and after each append.

    Each call returns the hashes of the blocks that became full since `request.block_hashes` was
    last extended (the request appends them). Partial trailing blocks are never hashed. The first
    block's parent is `none_hash`, or the process's NONE_HASH (read at each call) when None.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    fn = _resolve(hash_fn)
    sha256 = hashlib.sha256 if fn is _sha256 else None
    stride = 4 * block_size
    # Splits packed tokens into per-block byte strings in C (cheaper than slicing in Python).
    split_blocks = struct.Struct(f"{stride}s").iter_unpack

    def request_block_hasher(request: Request) -> list[BlockHash]:
        """Hashes of the request's blocks that became full since block_hashes was extended."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start_block = len(hashes)
        end_block = len(tokens) // block_size
        if end_block <= start_block:
            return []
        start = start_block * block_size
        raw = _pack_tokens(tokens[start : end_block * block_size])
        if start_block:
            parent = hashes[-1]
        else:
            parent = NONE_HASH if none_hash is None else none_hash
        if (
            request.lora_name is None
            and request.cache_salt is None
            and request.prompt_embeds is None
        ):
            # The hot path: no extra keys, so the input is just parent || tokens.
            if end_block - start_block == 1:  # decode completed one block
                return [sha256(parent + raw).digest() if sha256 is not None else fn(parent + raw)]
            if sha256 is not None:
                return [parent := sha256(parent + chunk).digest() for (chunk,) in split_blocks(raw)]
            return [parent := fn(parent + chunk) for (chunk,) in split_blocks(raw)]
        offsets = range(0, len(raw), stride)
        new: list[BlockHash] = []
        for i, offset in enumerate(offsets):
            block_start = start + i * block_size
            extra = generate_block_extra_keys(request, block_start, block_start + block_size, fn)
            parent = fn(parent + raw[offset : offset + stride] + encode_extra_keys(extra))
            new.append(parent)
        return new

    return request_block_hasher
