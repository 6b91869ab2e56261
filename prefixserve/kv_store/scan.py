"""A full walk of a KV store directory: what it holds, and the cleaning only a walk can do.

Every process sharing a store writes and deletes files, so a process's running byte total drifts;
`scan_store` recounts it from the directory (every namespace under the root), deletes the files
whose expiry (their mtime, see disk_store.py) has passed and the temporary files of killed
writers, and can list the live files with their last use (atime) for eviction. A file that
vanishes while the walk runs is skipped; nothing here raises for it.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field

from prefixserve.kv_store.fs import is_stale_temp, is_temp_name, unlink_quietly
from prefixserve.kv_store.record import is_expired

NAMESPACE_NAME = re.compile(r"^[0-9a-f]{32}$")
SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")
RECORD_NAME = re.compile(r"^[0-9a-f]{2,128}-g[0-9]{1,5}\.kv$")


@dataclass(slots=True)
class ScanResult:
    """What one walk found and removed."""

    total_bytes: int = 0  # live record files
    expired: int = 0  # expired files this walk deleted
    temps_removed: int = 0  # abandoned temporary files this walk deleted
    files: list[tuple[int, int, str]] = field(default_factory=list)  # (atime ns, size, path)


def _listdir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _subdirs(path: str, name: re.Pattern[str]) -> list[os.DirEntry[str]]:
    return [e for e in _listdir(path) if name.match(e.name) and e.is_dir(follow_symlinks=False)]


def scan_store(root: str, now_ns: int, collect: bool) -> ScanResult:
    """Walk `<root>/<namespace>/<shard>/` (unknown names are left alone): count live record bytes,
    delete expired records (expiry <= `now_ns`) and stale temporary files, and with `collect`
    list the live records."""
    wall = time.time()
    result = ScanResult()
    for space in _subdirs(root, NAMESPACE_NAME):
        for shard in _subdirs(space.path, SHARD_NAME):
            for entry in _listdir(shard.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if is_temp_name(entry.name):
                    if is_stale_temp(entry.name, st, wall):
                        result.temps_removed += unlink_quietly(entry.path)
                    continue
                if not RECORD_NAME.match(entry.name) or not stat.S_ISREG(st.st_mode):
                    continue
                if is_expired(st.st_mtime_ns, now_ns):
                    result.expired += unlink_quietly(entry.path)
                    continue
                result.total_bytes += st.st_size
                if collect:
                    result.files.append((st.st_atime_ns, st.st_size, entry.path))
    return result


def namespace_records(space_dir: str) -> list[str]:
    """The paths of every record file in one namespace directory `<root>/<namespace>` (regular
    files with a record's name; links and anything else are not listed)."""
    paths = []
    for shard in _subdirs(space_dir, SHARD_NAME):
        for entry in _listdir(shard.path):
            if RECORD_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                paths.append(entry.path)
    return paths
