"""Cache salts: the namespace string chained into a prompt's first block hash.

A client may send a `cache_salt` (vLLM's field) to keep its blocks apart from everyone else's. The
engine's salt is never the client's string as sent: it is derived here, so no client can choose a
salt that lands in a namespace it does not own.

- With a tenant (a server with API keys): JSON of ("prefixserve.tenant.v1", tenant, client salt).
- Without one (a keyless server, the offline API): JSON of ("prefixserve.open.v1", client salt),
  or no salt at all when the client sent none.

JSON escapes its strings, so distinct inputs give distinct salts (no "ab"+"c" == "a"+"bc"), and the
two shapes never meet: a keyless client cannot reach a tenant's blocks, even on a disk store that a
keyed server shares, by sending that tenant's derived salt (it is wrapped again), and no tenant
reaches a keyless client's. The version tags keep a future derivation from colliding with this one.
Pure Python: the server and the offline API both derive and validate here, so they refuse the same
salts.
"""

from __future__ import annotations

import json

MAX_CACHE_SALT_CHARS = 256
TENANT_NAMESPACE = "prefixserve.tenant.v1"
OPEN_NAMESPACE = "prefixserve.open.v1"


def validate_cache_salt(cache_salt: object) -> None:
    """Raise ValueError naming `cache_salt` unless it is None or 1..256 characters of text."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string (or left out)")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}"
        )
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be Unicode text (it holds a lone surrogate)") from None


def derive_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The engine's cache salt for a request of `tenant` (None: no tenants) carrying the
    client's `cache_salt` (see the module docstring for the two namespaces)."""
    if tenant is None:
        if client_salt is None:
            return None
        return _encode([OPEN_NAMESPACE, client_salt])
    return _encode([TENANT_NAMESPACE, tenant, client_salt])


def _encode(parts: list[str | None]) -> str:
    return json.dumps(parts, ensure_ascii=True, separators=(",", ":"))
