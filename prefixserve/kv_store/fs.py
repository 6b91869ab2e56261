"""Private directories and files for the KV store: 0700 directories, 0600 files, checked owners.

The store holds token ids (a tenant's prompt text, in effect) and the secret seed of the hash
chain, so nothing in it may be readable by another user. `ensure_private_dir` creates the root
or refuses one that is not safe; files are always created with O_EXCL and 0600 under a temporary
name (`temp_name`) and renamed into place, so a reader never sees a half-written file. A writer
killed mid-write leaves a temporary file that `is_stale_temp` recognizes (its process is gone, or
it is older than `STALE_TEMP_SECONDS`) and the next scan removes.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# Flags for creating a private file that must not exist yet (and must not be a symlink).
CREATE_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# A temporary file this old is abandoned even when a process with its pid exists (the pid may
# have been reused, or belong to another pid namespace sharing the directory).
STALE_TEMP_SECONDS = 600.0

_TEMP_NAME = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")


class UnsafeStoreError(PermissionError):
    """A store path that another user could read or write: refused, never used."""


def ensure_private_dir(path: Path) -> None:
    """Create directory `path` with mode 0700 (parents with the default mode), or check an
    existing one: it must be a directory owned by this user with no group/other permission.

    Raises UnsafeStoreError naming the path, what is wrong and how to fix it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
        os.chmod(path, PRIVATE_DIR_MODE)  # a umask may have taken bits we need
    except FileExistsError:
        pass
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"KV store path {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreError(
            f"KV store directory {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); use a directory of your own"
        )
    if st.st_mode & 0o077:
        raise UnsafeStoreError(
            f"KV store directory {path} is open to group/others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); it must be private: chmod 700 {path}, "
            "or choose a new directory"
        )


def make_private_subdir(path: str) -> None:
    """mkdir `path` with mode 0700 if it is missing (its parent must exist)."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass


def check_private_file(path: Path, st: os.stat_result) -> None:
    """Refuse a secret file that is not a regular file of this user readable by nobody else."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStoreError(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
            "refusing to use it"
        )
    if st.st_mode & 0o077:
        raise UnsafeStoreError(
            f"{path} is readable or writable by group/others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); it must be 0600: chmod 600 {path}"
        )


def temp_name(final_name: str) -> str:
    """A unique temporary name for a file that will be renamed to `final_name`; it carries this
    process's pid so that a later scan can tell an abandoned one."""
    return f".{final_name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def is_temp_name(name: str) -> bool:
    """Whether `name` was made by `temp_name`."""
    return _TEMP_NAME.match(name) is not None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OverflowError:
        return False
    return True


def is_stale_temp(name: str, st: os.stat_result, now: float | None = None) -> bool:
    """Whether temporary file `name` (stat `st`) is abandoned: its writer's pid is not alive, or
    it has not changed for STALE_TEMP_SECONDS. A live writer whose file is removed anyway only
    loses that write (its rename fails); it never publishes a partial file."""
    match = _TEMP_NAME.match(name)
    if match is None:
        return False
    now = time.time() if now is None else now
    if now - st.st_ctime > STALE_TEMP_SECONDS:
        return True
    pid = int(match.group(1))
    return pid != os.getpid() and not _pid_alive(pid)


def unlink_quietly(path: str) -> bool:
    """Remove `path`; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def write_all(fd: int, buffers: Sequence[bytes | memoryview]) -> int:
    """Write every byte of `buffers` to `fd` (looping over short writes); returns the count."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return total
