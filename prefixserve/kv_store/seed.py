"""The store's secret seed: 32 random bytes created once with the store, readable only by its user.

Block hashes must be stable across restarts for the disk tier to hit, so the hash chain's first
parent (NONE_HASH) cannot be a per-process random value; it must not be guessable either, or a
tenant could compute another tenant's block hashes. The store therefore keeps its own secret:
`<root>/seed`, mode 0600 in the 0700 root, and every process using the store derives NONE_HASH
from it.

Creation is atomic and race-free: the seed is written in full to a private temporary file, then
hard-linked to the final name, which fails when the name exists; the loser of a race reads the
winner's complete file, so two processes starting together always agree. (On a filesystem without
hard links, the final name is created with O_EXCL and a reader waits briefly for its 32 bytes.)
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from prefixserve.kv_store.fs import (
    CREATE_EXCLUSIVE,
    OPEN_READ,
    UnsafeStoreError,
    check_private_file,
    ensure_private_dir,
    is_stale_temp,
    is_temp_name,
    temp_name,
    unlink_quietly,
    write_all,
)

SEED_BYTES = 32
SEED_FILE = "seed"
# How long a reader waits for a seed that another process is writing (filesystems without links).
_PARTIAL_SEED_WAIT_S = 2.0
_NO_LINK_ERRNOS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


class SeedError(UnsafeStoreError):
    """The seed file exists but cannot be used (bad permissions, owner or length)."""


def load_or_create_seed(root: Path) -> bytes:
    """Return the store's 32-byte secret seed, creating `root` (0700) and the seed (0600) on first
    use. Two processes calling this at once get the same seed.

    Raises UnsafeStoreError when `root` is not private, SeedError when the seed file is readable
    by group/others, owned by another user or not exactly 32 bytes.
    """
    root = Path(root)
    ensure_private_dir(root)
    _remove_stale_temps(root)
    path = root / SEED_FILE
    if not path.exists():
        _create(root, path)
    return _read(path)


def _create(root: Path, path: Path) -> None:
    """Publish a new random seed at `path` unless one is there already."""
    seed = os.urandom(SEED_BYTES)
    tmp = root / temp_name(SEED_FILE)
    fd = os.open(tmp, CREATE_EXCLUSIVE, 0o600)
    try:
        try:
            write_all(fd, [seed])
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return  # another process won the race; its seed is complete
        except OSError as exc:
            if exc.errno not in _NO_LINK_ERRNOS:
                raise
            _create_without_link(path, seed)
    finally:
        unlink_quietly(str(tmp))


def _create_without_link(path: Path, seed: bytes) -> None:
    try:
        fd = os.open(path, CREATE_EXCLUSIVE, 0o600)
    except FileExistsError:
        return
    try:
        write_all(fd, [seed])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> bytes:
    deadline = time.monotonic() + _PARTIAL_SEED_WAIT_S
    while True:
        try:
            fd = os.open(path, OPEN_READ)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SeedError(f"KV store seed {path} is a symbolic link; refusing it") from None
            raise
        try:
            st = os.fstat(fd)
            try:
                check_private_file(path, st)
            except UnsafeStoreError as exc:
                raise SeedError(f"KV store seed: {exc}") from None
            data = os.pread(fd, SEED_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(data) == SEED_BYTES:
            return data
        # Only a seed being written right now (no-link filesystems) is worth waiting for.
        if len(data) > SEED_BYTES or time.time() - st.st_mtime > 10 or time.monotonic() > deadline:
            raise SeedError(
                f"KV store seed {path} has {len(data)} bytes, not {SEED_BYTES}; it is damaged. "
                "Delete it to start a new store (its blocks become unreachable)."
            )
        time.sleep(0.02)


def _remove_stale_temps(root: Path) -> None:
    """Remove seed temp files left by killed processes."""
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(f".{SEED_FILE}.") or not is_temp_name(entry.name):
                continue
            try:
                if is_stale_temp(entry.name, entry.stat(follow_symlinks=False)):
                    unlink_quietly(entry.path)
            except FileNotFoundError:
                pass
