"""The on-disk record of one block of one KV-cache group, and its checks.

    fixed header   magic b"PSKVBLK\\0", format version (u32), namespace (16 bytes), group (u32),
                   hash length (u32), parent hash length (u32), number of tokens (u32),
                   payload length (u64), expiry (u64 unix nanoseconds, 0 = never)
    block hash     hash length bytes
    parent hash    parent hash length bytes: the hash of the block before it in its prompt (the
                   chain's seed for a first block), a second check beside the chained hash
    token ids      number of tokens x int32, little-endian
    payload        payload length bytes: the block's K/V for the group's layers (opaque here)
    checksum       xxh3-128 of everything above (16 bytes); on a tier with a key (tier_key.py),
                   the keyed BLAKE3 MAC of everything above instead, its first 16 bytes

All integers are little-endian. A reader knows the hash, the parent and the token ids it asks
for, so it knows the header's length before reading it and the record's exact length after;
anything else (another length, magic, version, namespace, hash, parent, group, token ids, or
checksum) is a `RecordError`, whose
`kind` says whether the file is corrupt (damaged or truncated), foreign (a valid record of
something else: another namespace, format, or a hash collision) or, on a keyed tier,
unauthenticated (its MAC does not verify: damaged, or written by someone without the key).
"""

from __future__ import annotations

import functools
import hmac
import os
import stat
import struct

import xxhash

from prefixserve.kv_store.tier_key import TierKey

MAGIC = b"PSKVBLK\x00"
FORMAT_VERSION = 2  # 2: the parent hash
FIXED = struct.Struct("<8sI16sIIIIQQ")
CHECKSUM_BYTES = 16
MAX_HASH_BYTES = 64
MAX_GROUP = 0xFFFF
NAMESPACE_BYTES = 16

CORRUPT = "corrupt"
FOREIGN = "foreign"
UNAUTHENTICATED = "unauthenticated"


class RecordError(ValueError):
    """A file that is not the asked-for block: `kind` is CORRUPT or FOREIGN."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind} KV store record: {reason}")
        self.kind = kind


def is_expired(expires_at_ns: int, now_ns: int) -> bool:
    """Whether an expiry (unix ns, 0 = never) has passed."""
    return 0 < expires_at_ns <= now_ns


@functools.lru_cache(maxsize=64)
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}i")


def pack_tokens(token_ids: object) -> bytes:
    """Token ids as little-endian int32; ValueError when one is not an int32."""
    ids = list(token_ids)  # type: ignore[call-overload]
    try:
        return _tokens_struct(len(ids)).pack(*ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 values: {exc}") from None


def header_length(hash_len: int, num_tokens: int, parent_len: int = 0) -> int:
    """Bytes before the payload."""
    return FIXED.size + hash_len + parent_len + 4 * num_tokens


def record_length(hash_len: int, num_tokens: int, payload_len: int, parent_len: int = 0) -> int:
    """Bytes of the whole file."""
    return header_length(hash_len, num_tokens, parent_len) + payload_len + CHECKSUM_BYTES


def encode_header(
    namespace: bytes,
    block_hash: bytes,
    group: int,
    tokens: bytes,
    payload_len: int,
    expires_at_ns: int,
    parent: bytes = b"",
) -> bytes:
    """The bytes before the payload (`tokens` as `pack_tokens` returns them)."""
    fixed = FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        namespace,
        group,
        len(block_hash),
        len(parent),
        len(tokens) // 4,
        payload_len,
        expires_at_ns,
    )
    return fixed + block_hash + parent + tokens


def checksum(header: bytes, payload: bytes | memoryview, key: TierKey | None = None) -> bytes:
    """xxh3-128 of header + payload, or their MAC under `key`."""
    if key is not None:
        return key.tag(header, payload)
    digest = xxhash.xxh3_128(header)
    digest.update(payload)
    return digest.digest()


def verify(
    tail: bytes, header: bytes, payload: bytes | memoryview, key: TierKey | None = None
) -> None:
    """RecordError unless `tail` is the checksum (or, with `key`, the MAC) of header + payload:
    CORRUPT for a checksum, UNAUTHENTICATED for a MAC (compared in constant time)."""
    if key is None:
        if tail != checksum(header, payload):
            raise RecordError(CORRUPT, "checksum mismatch")
    elif not hmac.compare_digest(tail, key.tag(header, payload)):
        raise RecordError(UNAUTHENTICATED, "MAC mismatch (damaged, or written without the key)")


def parse_header(
    head: bytes, block_hash: bytes, num_tokens: int, parent_len: int = 0
) -> tuple[int, int]:
    """(payload length, expiry ns) from the first `header_length` bytes of a file that should
    hold `block_hash` with `num_tokens` tokens after a `parent_len`-byte parent hash;
    RecordError when the fixed part says otherwise. The identity fields are checked by
    `check_identity`, after the checksum."""
    if len(head) != header_length(len(block_hash), num_tokens, parent_len):
        raise RecordError(CORRUPT, f"header truncated ({len(head)} bytes)")
    magic, version, _, _, hash_len, stored_parent_len, tokens, payload_len, expires_at_ns = (
        FIXED.unpack_from(head)
    )
    if magic != MAGIC:
        raise RecordError(CORRUPT, "bad magic")
    if version != FORMAT_VERSION:
        raise RecordError(FOREIGN, f"format version {version}, not {FORMAT_VERSION}")
    if hash_len != len(block_hash) or tokens != num_tokens or stored_parent_len != parent_len:
        raise RecordError(
            FOREIGN, f"{hash_len}-byte hash, {stored_parent_len}-byte parent and {tokens} tokens"
        )
    return payload_len, expires_at_ns


def check_identity(
    head: bytes,
    namespace: bytes,
    block_hash: bytes,
    group: int,
    tokens: bytes,
    parent: bytes = b"",
) -> None:
    """RecordError(FOREIGN) unless a checksummed header names exactly this block."""
    _, _, stored_namespace, stored_group, *_ = FIXED.unpack_from(head)
    if stored_namespace != namespace:
        raise RecordError(FOREIGN, "another namespace (model, dtype, block size or layout)")
    if stored_group != group:
        raise RecordError(FOREIGN, f"group {stored_group}, not {group}")
    start = FIXED.size
    if head[start : start + len(block_hash)] != block_hash:
        raise RecordError(FOREIGN, "another block hash")
    start += len(block_hash)
    if head[start : start + len(parent)] != parent:
        raise RecordError(FOREIGN, "same hash, another parent (a hash collision)")
    if head[start + len(parent) :] != tokens:
        raise RecordError(FOREIGN, "same hash, other token ids (a hash collision)")


def read_record(
    fd: int,
    st: os.stat_result,
    namespace: bytes,
    block_hash: bytes,
    group: int,
    tokens: bytes,
    out: memoryview | None,
    now_ns: int,
    parent: bytes = b"",
    key: TierKey | None = None,
) -> bytes | None:
    """Read and verify the record open at `fd` (fstat `st`) as block (`block_hash`, `group`) with
    `tokens`: its payload (or b"" once it is read into `out`, a byte view of the payload's exact
    size), None when it has expired. RecordError for anything that is not exactly this block
    (with `key`, also a record whose MAC does not verify)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise RecordError(FOREIGN, "not a regular file of this user")
    num_tokens = len(tokens) // 4
    head_len = header_length(len(block_hash), num_tokens, len(parent))
    head = os.pread(fd, head_len, 0)
    payload_len, expires_at_ns = parse_header(head, block_hash, num_tokens, len(parent))
    if st.st_size != record_length(len(block_hash), num_tokens, payload_len, len(parent)):
        raise RecordError(CORRUPT, f"length {st.st_size} (truncated?)")
    if out is not None and out.nbytes != payload_len:
        raise RecordError(FOREIGN, f"{payload_len}-byte payload, not {out.nbytes}")
    if out is None:
        payload: bytes | memoryview = os.pread(fd, payload_len, head_len)
        got = len(payload)
    else:
        payload = out
        got = os.preadv(fd, [out], head_len) if payload_len else 0
    tail = os.pread(fd, CHECKSUM_BYTES, head_len + payload_len)
    if got != payload_len:
        raise RecordError(CORRUPT, f"{got} payload bytes read, not {payload_len}")
    verify(tail, head, payload, key)
    check_identity(head, namespace, block_hash, group, tokens, parent)
    if is_expired(expires_at_ns, now_ns):
        return None
    return b"" if out is not None else payload  # type: ignore[return-value]


def encode_record(
    namespace: bytes,
    block_hash: bytes,
    group: int,
    tokens: bytes,
    payload: bytes | memoryview,
    parent: bytes = b"",
    key: TierKey | None = None,
) -> bytes:
    """A whole record as one bytes value (a shared tier's value; no expiry: the tier's TTL
    is the retention), checksummed, or with `key` MACed."""
    header = encode_header(namespace, block_hash, group, tokens, len(payload), 0, parent)
    return b"".join((header, payload, checksum(header, payload, key)))


def decode_record(
    value: bytes,
    namespace: bytes,
    block_hash: bytes,
    group: int,
    tokens: bytes,
    parent: bytes = b"",
    key: TierKey | None = None,
) -> bytes:
    """The payload of a record held as one bytes value, checked as `read_record` checks a file:
    RecordError for anything that is not exactly this block (damaged, truncated, foreign; with
    `key`, a MAC that does not verify)."""
    num_tokens = len(tokens) // 4
    head_len = header_length(len(block_hash), num_tokens, len(parent))
    head = value[:head_len]
    payload_len, _ = parse_header(head, block_hash, num_tokens, len(parent))
    if len(value) != record_length(len(block_hash), num_tokens, payload_len, len(parent)):
        raise RecordError(CORRUPT, f"length {len(value)} (truncated?)")
    payload = value[head_len : head_len + payload_len]
    verify(value[head_len + payload_len :], head, payload, key)
    check_identity(head, namespace, block_hash, group, tokens, parent)
    return payload
