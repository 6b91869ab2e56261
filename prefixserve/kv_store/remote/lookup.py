"""`RemoteLookup`: the read-only face of one namespace on a shared Redis/Valkey server.

What every reader of the shared tier needs and nothing more: the key of a block, the lookup
(how many leading blocks the server holds, one pipelined round trip of EXISTS), and faults as
misses with a back-off. `RedisTier` (redis_tier.py) builds the engine's tier on it (loads and
writes); the cluster router opens one on the replicas' server to price the blocks it holds
(cluster/remote_probe.py), as it opens a `StoreLookup` on a shared disk store. Neither reads a
seed from the server: the hash chain's seed comes from the deployment's key file
(kv_store/tier_key.py), which the server never sees.

Faults are misses, never errors: a call that fails (down, slow past the socket timeout,
refused) answers "none held", counts `fault_<what>` in `stats`, and the server is not called
for `retry_after_s` (doubling on each fault in a row, up to `MAX_RETRY_AFTER_S`); calls
meanwhile are misses at once, counted `skipped_down`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

logger = logging.getLogger(__name__)

KEY_PREFIX = b"psk:"
# Seconds one command may take before it counts as a fault (a miss).
DEFAULT_SOCKET_TIMEOUT_S = 0.5
# Seconds the server is not called after a fault (doubled on each fault in a row, up to the max).
DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 8.0


class RemoteConfigError(ValueError):
    """A `--kv-remote` URL or password file that cannot be used."""


def read_password(path: str | Path | None) -> str | None:
    """The password in `path` (one line; surrounding whitespace dropped), or None;
    RemoteConfigError, naming the flag, for a file that is missing, not a file, or empty."""
    if path is None:
        return None
    flag = "--kv-remote-password-file"
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise RemoteConfigError(f"{flag} {path}: cannot read it ({reason})") from None
    if not text:
        raise RemoteConfigError(f"{flag} {path}: the file is empty")
    return text


# Query parameters redis-py would take as credentials (it reads any of its connection keywords
# from the query string, and the URL's value wins over the password file's).
_SECRET_QUERY_NAMES = ("password", "passwd", "pass", "auth", "credential", "token", "secret")


def check_url(url: str) -> None:
    """RemoteConfigError, naming `--kv-remote`, unless `url` is redis://, rediss:// or unix://
    without a password anywhere in it (user info or query string) and with a valid port."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise RemoteConfigError(
            f"--kv-remote must be redis://, rediss:// or unix://, got {_redacted(parts)!r}"
        )
    query_names = [name.lower() for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
    if parts.password is not None or any(
        secret in name for name in query_names for secret in _SECRET_QUERY_NAMES
    ):
        raise RemoteConfigError(
            "--kv-remote must not carry a password (in the user info or the query string): give "
            "it in a file (--kv-remote-password-file)"
        )
    try:
        parts.port  # noqa: B018  (urlsplit checks the port only when asked for it)
    except ValueError as exc:
        raise RemoteConfigError(f"--kv-remote: {exc} in {_redacted(parts)!r}") from None
    if parts.scheme != "unix" and not parts.hostname:
        raise RemoteConfigError(f"--kv-remote: no host in {_redacted(parts)!r}")


def _redacted(parts) -> str:  # noqa: ANN001  (a SplitResult)
    """The URL without its user info and query string (where a secret could hide)."""
    netloc = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=netloc, query="", fragment="").geturl()


def redacted_url(url: str) -> str:
    """`url` as it may be logged or sent: no user info, no query string."""
    return _redacted(urlsplit(url))


class RemoteLookup:
    """Lookups in one namespace (32 hex digits) of the server at `url`; nothing written."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        password_file: str | Path | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        import redis

        check_url(url)
        self._init_state(url, namespace, password_file, retry_after_s)
        self._client = redis.Redis.from_url(
            url,
            password=read_password(password_file),
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=30,
        )
        self._errors = (redis.RedisError, OSError)

    def _init_state(
        self, url: str, namespace: str, password_file: str | Path | None, retry_after_s: float
    ) -> None:
        """Everything but the client: the namespace, the fault counts, the back-off."""
        if len(namespace) != 32:
            raise ValueError(f"namespace must be 32 hex digits, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        # A path, kept so that a reader of the same server can be opened elsewhere (the router).
        self.password_file = None if password_file is None else str(password_file)
        self.stats: Counter[str] = Counter()
        # Whether the latest call reached the server (False until one did, and after a fault).
        self.connected = False
        self.retry_after_s = retry_after_s
        self._backoff_s = retry_after_s
        self._retry_at = 0.0  # monotonic time before which the server is not called

    def sibling(self, namespace: str) -> RemoteLookup:
        """A lookup in another namespace of the same server over this one's connections (its
        own fault counts and back-off): how a cache report looks where engines of another KV
        dtype keep their blocks. Never closed itself (the connections are this one's)."""
        other = object.__new__(RemoteLookup)  # not __init__: no new client
        other._init_state(self.url, namespace, self.password_file, self.retry_after_s)
        other._client, other._errors = self._client, self._errors
        return other

    def key(self, block_hash: bytes, group: int) -> bytes:
        return KEY_PREFIX + f"{self.namespace}:{block_hash.hex()}:g{group}".encode()

    def lookup(self, block_hashes: Sequence[bytes], group: int = 0) -> int:
        """How many leading `block_hashes` the server holds (one round trip); 0 on a fault."""
        return self.probe(block_hashes, group)[0]

    def probe(self, block_hashes: Sequence[bytes], group: int = 0) -> tuple[int, str | None]:
        """`lookup`, and "unreachable" when a fault answered it (else None)."""
        held, fault = self.held(block_hashes, group)
        count = 0
        for found in held:
            if not found:
                break
            count += 1
        return count, fault

    def held(self, block_hashes: Sequence[bytes], group: int = 0) -> tuple[list[bool], str | None]:
        """Whether the server holds each of `block_hashes` (one pipelined round trip of EXISTS),
        and "unreachable" when a fault answered it (then none is held)."""
        if not block_hashes:
            return [], None
        if not self._callable():
            return [False] * len(block_hashes), "unreachable"
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in block_hashes:
                pipe.exists(self.key(block_hash, group))
            found = pipe.execute()
        except self._errors as exc:
            self._fault("lookup", exc)
            return [False] * len(block_hashes), "unreachable"
        self._reached()
        return [bool(n) for n in found], None

    def ping(self) -> bool:
        """Whether the server answers now (a fault is counted, and backs off, as any call's)."""
        if not self._callable():
            return False
        try:
            self._client.ping()
        except self._errors as exc:
            self._fault("ping", exc)
            return False
        self._reached()
        return True

    # ------------------------------------------------------------------ faults

    def _callable(self) -> bool:
        """Whether to call the server now: not while backing off after a fault (a skipped call
        is counted)."""
        if time.monotonic() < self._retry_at:
            self.stats["skipped_down"] += 1
            return False
        return True

    def _reached(self) -> None:
        """A call succeeded: connected again, the back-off reset."""
        self.connected = True
        self._backoff_s = self.retry_after_s

    def _fault(self, what: str, exc: BaseException) -> None:
        self.connected = False
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(MAX_RETRY_AFTER_S, max(self._backoff_s * 2, self.retry_after_s))
        self.stats[f"fault_{what}"] += 1
        logger.debug("kv-remote %s failed: %s", what, exc)

    def close(self) -> None:
        self._client.close()
