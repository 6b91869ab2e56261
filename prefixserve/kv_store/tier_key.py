"""`TierKey`: the secret that makes a tier's values unforgeable, from a key file the hosts share.

A tier that others can write (a Redis/Valkey server shared by the hosts, a disk directory that
several hosts mount, under one user id, from a network filesystem) must not let whoever can
write it choose a tenant's K/V: a value's xxh3 checksum is public arithmetic, and anyone can
recompute it over a forged payload. So a value on such a tier carries a keyed MAC instead
(BLAKE3 in keyed mode, its first 16 bytes, in the record's checksum field), computed with a key
that never goes to the tier. A value whose MAC does not verify is a miss, counted and deleted
(record.py `UNAUTHENTICATED`).

The key file holds at least 32 bytes of secret (e.g. `openssl rand -hex 32`), surrounding
whitespace dropped, and must be readable by its owner alone (this user, or root). Two keys are
derived from it (BLAKE3's key derivation, one context string each): the MAC key, and the hash
chain's seed, so the hosts that share the file hash alike without reading a seed from the tier
(where a writer could change it, and from where a host started while the tier is down could
not read it).

BLAKE3 (the `blake3` package) MACs ~7.6 GB/s over a block on one AVX-512 core (xxh3 ~49,
HMAC-SHA256 ~1.7, keyed BLAKE2b ~1.0): a joining host's loads keep 0.84-0.87x of their speed,
~50x what a prefill of the same tokens costs (BENCHMARKS.md, "Shared tier: the MAC's cost").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3

MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
TAG_BYTES = 16
_MAC_CONTEXT = "prefixserve 2026-12 KV tier record MAC"
_SEED_CONTEXT = "prefixserve 2026-12 KV tier hash-chain seed"


class TierKeyError(ValueError):
    """A key file that cannot be used: missing, not a regular file, open to others, too short."""


class TierKey:
    """The MAC key and the hash seed derived from one secret (`from_file` reads it)."""

    __slots__ = ("_mac_key", "path", "seed", "source")

    def __init__(self, secret: bytes, source: str = "", path: str | None = None) -> None:
        if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
            raise TierKeyError(
                f"{source or 'the key'} holds {len(secret)} bytes; a key is {MIN_KEY_BYTES} to "
                f"{MAX_KEY_BYTES} bytes of secret (e.g. `openssl rand -hex 32`)"
            )
        self._mac_key = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self.seed = blake3.blake3(secret, derive_key_context=_SEED_CONTEXT).digest()
        self.source = source
        self.path = path  # the key file's, when read from one (a reader elsewhere reads it too)

    @classmethod
    def from_file(cls, path: str | Path, flag: str) -> TierKey:
        """The key in `path`; TierKeyError, naming `flag`, for a file that cannot be used."""
        return cls(read_key_file(path, flag), f"{flag} {path}", str(path))

    def tag(self, header: bytes, payload: bytes | memoryview) -> bytes:
        """The MAC of a record's header and payload (`TAG_BYTES` bytes)."""
        mac = blake3.blake3(header, key=self._mac_key)
        mac.update(payload)
        return mac.digest(TAG_BYTES)

    def __repr__(self) -> str:  # never the secret
        return f"TierKey({self.source or 'in memory'})"


def read_key_file(path: str | Path, flag: str) -> bytes:
    """The secret in the key file `path` (whitespace around it dropped); TierKeyError naming
    `flag` when the file is missing, not a regular file, readable or writable by group or
    others, or of the wrong length."""
    path = Path(path).expanduser()
    try:  # symbolic links followed (a Kubernetes secret is one); a FIFO never blocks the start
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise TierKeyError(f"{flag} {path}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TierKeyError(f"{flag} {path}: not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise TierKeyError(f"{flag} {path}: owned by another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise TierKeyError(
                f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read or change "
                "the key; chmod 600 it"
            )
        data = os.read(fd, MAX_KEY_BYTES + 1024)
    finally:
        os.close(fd)
    secret = data.strip()
    if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
        raise TierKeyError(
            f"{flag} {path}: holds {len(secret)} bytes; a key is {MIN_KEY_BYTES} to "
            f"{MAX_KEY_BYTES} bytes of secret (e.g. `openssl rand -hex 32 > {path.name}`)"
        )
    return secret
