"""API keys, tenants, and the cache-salt namespace each tenant gets.

Prefix-cache timing is a side channel: a client that can hit another client's cached blocks can
learn from the time to first token whether that client sent a prefix. With API keys configured,
the server therefore derives the engine's `cache_salt` from the *tenant* the key belongs to plus
the client's own `cache_salt` (`kv_cache/salts.py`), so tenants never share a block whatever
they send, and a client's salt only subdivides its tenant's namespace; without keys, clients'
salts live in a namespace of their own that no tenant's salt can be forged into.

Two roles: a *tenant* key (`--api-key`, `--api-key-file`) may call the inference endpoints; an
*operator* key (`--admin-api-key-file`, same file format, the second word naming the operator)
may call the operator endpoints (KV events, cache reset, global metrics) and nothing else. The
key files have no role column: which file a key is in is its role, and one key cannot be both.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TENANT = "default"


def _digest(key: str) -> bytes:
    # Keys are looked up by digest: a dict probe on the digest leaks nothing about the key's bytes.
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(slots=True)
class ApiKeys:
    """Which tenant each API key belongs to. Several keys may share one tenant."""

    _tenant_by_digest: dict[bytes, str] = field(default_factory=dict)
    _admin_by_digest: dict[bytes, str] = field(default_factory=dict)

    def add(self, key: str, tenant: str) -> None:
        """Add a tenant key."""
        self._tenant_by_digest[self._new_digest(key, tenant)] = tenant

    def add_admin(self, key: str, name: str = "admin") -> None:
        """Add an operator key; `name` only labels it."""
        self._admin_by_digest[self._new_digest(key, name)] = name

    def _new_digest(self, key: str, owner: str) -> bytes:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
        if not key.isascii():
            # HTTP headers arrive as latin-1: a non-ASCII key could never match its header.
            raise ValueError(f"an API key must be ASCII (the key of {owner!r} is not)")
        if not owner or any(c.isspace() for c in owner):
            raise ValueError(
                f"a tenant name must be non-empty and contain no whitespace, got {owner!r}"
            )
        digest = _digest(key)
        if digest in self._tenant_by_digest or digest in self._admin_by_digest:
            raise ValueError(f"the same API key is given twice (owner {owner!r})")
        return digest

    def is_admin(self, key: str) -> bool:
        """Whether `key` is an operator key."""
        return _digest(key) in self._admin_by_digest

    @property
    def num_admin_keys(self) -> int:
        return len(self._admin_by_digest)

    def tenant_for(self, key: str) -> str | None:
        """The tenant of `key`, or None when the key is unknown."""
        return self._tenant_by_digest.get(_digest(key))

    @property
    def tenants(self) -> set[str]:
        return set(self._tenant_by_digest.values())

    def __len__(self) -> int:
        """The number of tenant keys."""
        return len(self._tenant_by_digest)

    @classmethod
    def from_options(
        cls,
        api_key: str | None = None,
        api_key_file: str | Path | None = None,
        admin_api_key_file: str | Path | None = None,
    ) -> ApiKeys | None:
        """Keys of `--api-key` (tenant "default"), `--api-key-file` and `--admin-api-key-file`;
        None when none is set (no auth: one trusted user)."""
        if api_key is None and api_key_file is None and admin_api_key_file is None:
            return None
        keys = cls()
        if api_key is not None:
            keys.add(api_key, DEFAULT_TENANT)
        for flag, path, add in (
            ("--api-key-file", api_key_file, keys.add),
            ("--admin-api-key-file", admin_api_key_file, keys.add_admin),
        ):
            if path is None:
                continue
            pairs = read_api_key_file(path)
            if not pairs:
                raise ValueError(f"{flag} {str(path)!r} holds no keys")
            for key, owner in pairs:
                add(key, owner)
        return keys


def read_api_key_file(path: str | Path) -> list[tuple[str, str]]:
    """Parse `key tenant` lines; blank lines and lines starting with `#` are skipped.

    A UTF-8 byte-order mark (editors on Windows write one) is not part of the first key."""
    pairs: list[tuple[str, str]] = []
    text = Path(path).read_text(encoding="utf-8-sig")
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(
                f"{path}:{lineno}: expected 'KEY TENANT' (two words), got {len(parts)} words"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


def parse_bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def parse_x_api_key(value: str | None) -> str | None:
    """The key of an `x-api-key: <key>` header (Anthropic's clients), or None."""
    if not value or not value.strip():
        return None
    return value.strip()


# A Basic credential longer than this is refused unread (keys are short; the header is bounded
# by the server's header limits anyway).
MAX_BASIC_CREDENTIAL_CHARS = 4096


def parse_basic_password(authorization: str | None) -> str | None:
    """The password of an `Authorization: Basic base64(user:password)` header, or None: how a
    browser sends the key to the inspector page (any user name, the key as the password)."""
    if not authorization or len(authorization) > MAX_BASIC_CREDENTIAL_CHARS:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = decoded.partition(":")
    return password if sep and password else None
