"""The store's compatibility key: which model, dtype, block size, hash and KV layout wrote a block.

K/V bytes are only meaningful to the exact model that computed them, in the same dtype and cache
layout. `model_fingerprint` digests a HF directory's config.json and the content of every
*.safetensors file (a GGUF file is fingerprinted through the directory it was converted into, so a
new conversion is a new fingerprint); `store_namespace` folds it with the dtype, block size, hash
algorithm and KV layout into the name of the store's subdirectory. A block written under another
namespace is never looked up, and each record also carries its namespace (`record.py`), so a file
copied across namespaces is refused.

Hashing multi-GB weights takes seconds, so each file's digest is cached in memory by (path,
device, inode, size, mtime_ns): a second call in the same process only stats the files.
xxh3-128 is not a cryptographic hash; the fingerprint guards against accidents (another model,
a re-conversion), not against someone who can already write the store directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import xxhash

# Bump when the bytes a block's payload holds change meaning for the same model, dtype and layout
# string (e.g. the runner's per-block K/V packing, or the kernels' arithmetic that computes it);
# every existing store then stops hitting. 2: the native GEMM's summation order of pairs of k
# (k + 1 before k, gemm_bf16_tiles.h), so blocks stored before it are not a new cold start's bits.
# 3: records of format 2 (record.py, the parent hash), kept apart from format 1's so that an
# upgraded host neither counts the old files as damaged nor reads them (they age out).
KV_LAYOUT_VERSION = 3

_CHUNK = 8 << 20
_digests: dict[tuple[str, int, int, int, int], str] = {}
_digests_lock = threading.Lock()


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    st = os.stat(path)
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _hash_file(path: Path) -> str:
    """xxh3-128 of the file's content, streamed in 8 MiB chunks."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """The content digest of `path`, cached in memory while its stat is unchanged."""
    key = _stat_key(path)
    with _digests_lock:
        cached = _digests.get(key)
    if cached is not None:
        return cached
    digest = _hash_file(path)
    if _stat_key(path) == key:  # not cached when the file changed while it was read
        with _digests_lock:
            _digests[key] = digest
    return digest


def model_fingerprint(model_dir: str | Path) -> str:
    """A 32-hex-digit digest of `model_dir`'s config.json bytes and every *.safetensors file
    (name, size and content). Raises ValueError when the directory has no config.json or no
    safetensors file."""
    directory = Path(model_dir)
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"cannot fingerprint model directory {directory}: no config.json")
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"cannot fingerprint model directory {directory}: no *.safetensors file")
    digest = xxhash.xxh3_128(b"prefixserve-model-fingerprint\x00")
    config_bytes = config.read_bytes()
    digest.update(len(config_bytes).to_bytes(8, "little") + config_bytes)
    for path in weights:
        name = path.name.encode()
        line = len(name).to_bytes(4, "little") + name + bytes.fromhex(file_digest(path))
        digest.update(line)
    return digest.hexdigest()


def store_namespace(
    model_fingerprint: str, dtype: str, block_size: int, hash_algo: str, kv_layout: str
) -> str:
    """The store subdirectory (32 hex digits) for blocks of this model, dtype, block size, block
    hash algorithm and KV layout (a string the runner builds from everything that shapes a block's
    bytes: layers per group, KV heads, head size, packing). Any difference gives another name.

    Raises ValueError for an empty string or a block size that is not a positive int.
    """
    for name, value in (
        ("model_fingerprint", model_fingerprint),
        ("dtype", dtype),
        ("hash_algo", hash_algo),
        ("kv_layout", kv_layout),
    ):
        if not isinstance(value, str) or not value:
            raise ValueError(f"store_namespace: {name} must be a non-empty string, got {value!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"store_namespace: block_size must be a positive int, got {block_size!r}")
    canonical = json.dumps(
        {
            "kv_layout_version": KV_LAYOUT_VERSION,
            "model": model_fingerprint,
            "dtype": dtype,
            "block_size": block_size,
            "hash_algo": hash_algo,
            "kv_layout": kv_layout,
        },
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
