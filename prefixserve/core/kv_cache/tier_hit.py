"""What the tiers below the RAM pool hold of one request, in tokens: the answer of a lookup
(`kv_store/connector.py` `KVStoreConnector.match`) and of a load (`load_into_pool`), which the
scheduler counts as computed and the cache report splits by tier.

A plain record in `core/` so that the scheduler and the cache reports read it without importing
the tiers (`kv_store/` fills it in)."""

from __future__ import annotations

from dataclasses import dataclass

# Why the shared tier (kv_store/remote/) served no block where it might have: it could not be
# reached (down, killed, timed out, refused), or the value it held was damaged, truncated or
# another block's. Either is a miss, never an error.
REMOTE_FAULTS: tuple[str, ...] = ("unreachable", "bad_value")
# The tiers below the RAM pool, nearest first, by the names `kv_store/tier.py` gives them.
DISK, REMOTE = "disk", "remote"


@dataclass(slots=True)
class TierHit:
    """Tokens after a RAM hit that the tiers below hold, contiguous: the local disk's run
    first (`disk_tokens`), then the shared tier's continuation (`remote_tokens`). A load fills
    in where each block actually came from (the nearest tier that held it), so a block the
    lookup found on disk may count as remote when its file vanished meanwhile.

    `remote_fault`: one of `REMOTE_FAULTS` when the shared tier's fault ended the run (the
    lookup or a read failed), else None."""

    disk_tokens: int = 0
    remote_tokens: int = 0
    remote_fault: str | None = None

    def __post_init__(self) -> None:
        if self.remote_fault is not None and self.remote_fault not in REMOTE_FAULTS:
            raise ValueError(f"unknown shared-tier fault {self.remote_fault!r}")

    def add(self, tier: str, tokens: int) -> None:
        """`tokens` more served by `tier` (DISK or REMOTE)."""
        if tier == DISK:
            self.disk_tokens += tokens
        elif tier == REMOTE:
            self.remote_tokens += tokens
        else:
            raise ValueError(f"unknown tier {tier!r}")

    def note_miss(self, tier: str, reason: str | None) -> None:
        """Why `tier` served nothing more: a shared-tier fault is kept, anything else is a
        plain miss."""
        if tier == REMOTE and reason in REMOTE_FAULTS:
            self.remote_fault = reason

    @property
    def tokens(self) -> int:
        """Every token the tiers below RAM serve (disk and shared)."""
        return self.disk_tokens + self.remote_tokens
