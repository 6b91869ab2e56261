"""Every environment variable prefixserve reads, the cache paths built on them, and a file lock.

This is the only module that touches `os.environ`; the rest of the package asks it. Values are
read at call time (not import time), so a test or a launcher may change them in-process.

- PREFIXSERVE_CACHE_DIR (`cache_root`): converted models and kernel builds (~/.cache/prefixserve)
- PREFIXSERVE_KERNELS (`kernels_enabled`): 0/off never builds or uses the native CPU kernels
- PREFIXSERVE_KERNEL_MARCH (`kernel_march`): the kernels' `-march` target instead of `native`
  (e.g. `haswell` builds the AVX2 kernels on an AVX-512 host, to test or time that kind)
- PREFIXSERVE_FP32_PREFILL (`fp32_prefill`): 1/0 forces the fp32 copy of bf16 linears on/off
- PREFIXSERVE_NATIVE_GEMM (`native_gemm`): 1/0 forces the native GEMM on/off for bf16 linears
- PREFIXSERVE_GEMM_TILES (`gemm_tiles`): the native GEMM's tile families instead of the host's
  calibration ("off": the build's FMA tiles, no calibration)
- PREFIXSERVE_PEERS_DIR (`peers_dir`): where `scripts/peers/` installed the benchmark peers
- PREFIXSERVE_KV_STORE (`kv_store_default_enabled`): 0/off turns the disk tier's default off
  (`prefixserve serve` and `LLM` without an explicit choice; the test suite sets it)
- PYTHONHASHSEED (`python_hash_seed`): seeds NONE_HASH so processes agree on block hashes
- OMP_WAIT_POLICY (`default_omp_wait_policy`, `omp_threads_sleep`): set to PASSIVE unless the
  user set it; while PASSIVE, decode-sized steps run on one thread (runner.py)
- PATH (`prepend_to_path`): ninja's directory goes first for the kernel build
- RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH (`use_ray_cluster_token`): a server joining
  a Ray cluster sends its token when there is one
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str) -> bool | None:
    """An on/off environment switch: True for 1/true/yes/on, False for 0/false/no/off, None when
    unset or anything else (the caller's default)."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def cache_root() -> Path:
    """Root of converted models and kernel builds: $PREFIXSERVE_CACHE_DIR or
    ~/.cache/prefixserve."""
    env = os.environ.get("PREFIXSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixserve"


def kernels_enabled() -> bool:
    """False only when PREFIXSERVE_KERNELS turns the native kernels off."""
    return env_flag("PREFIXSERVE_KERNELS") is not False


_MARCH = re.compile(r"[a-z0-9][a-z0-9.+_-]{0,39}")


def kernel_march() -> str:
    """PREFIXSERVE_KERNEL_MARCH: the `-march` the kernels are built for ("native" when unset);
    a value that is not a plain target name (letters, digits, `.+_-`) is refused, since it
    goes onto the compiler's command line."""
    value = os.environ.get("PREFIXSERVE_KERNEL_MARCH", "").strip().lower() or "native"
    if not _MARCH.fullmatch(value):
        raise ValueError(f"PREFIXSERVE_KERNEL_MARCH={value!r} is not a -march target name")
    return value


def fp32_prefill() -> bool | None:
    """PREFIXSERVE_FP32_PREFILL as a switch; None leaves the choice to the CPU (see
    model/layers/linear.py)."""
    return env_flag("PREFIXSERVE_FP32_PREFILL")


def native_gemm() -> bool | None:
    """PREFIXSERVE_NATIVE_GEMM as a switch; None: bf16 linears take csrc/linear/gemm_bf16.cpp
    wherever its vector tiles run (model/kernels/cpu_paths.py `native_gemm_wanted`)."""
    return env_flag("PREFIXSERVE_NATIVE_GEMM")


def gemm_tiles() -> str | None:
    """PREFIXSERVE_GEMM_TILES: the native GEMM's tile families, "FAMILY" for every call or
    "DECODE,PREFILL" (families: avx512, avx512_bf16, avx2, portable), "off" for the build's
    FMA tiles without a calibration; None (unset, empty or "auto"): the host's calibration
    (model/kernels/calibration.py)."""
    value = os.environ.get("PREFIXSERVE_GEMM_TILES", "").strip().lower()
    return None if value in ("", "auto") else value


def batch_invariant_env() -> bool | None:
    """VLLM_BATCH_INVARIANT as a switch (vLLM's name for the same mode): the default of the
    `batch_invariant` engine option; None when unset."""
    return env_flag("VLLM_BATCH_INVARIANT")


def peers_dir() -> Path:
    """Where scripts/peers/ put the benchmark peers' venvs: $PREFIXSERVE_PEERS_DIR or
    ~/.cache/prefixserve/peers."""
    env = os.environ.get("PREFIXSERVE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixserve" / "peers"


def python_hash_seed() -> str | None:
    """PYTHONHASHSEED, or None when unset or "random"."""
    seed = os.environ.get("PYTHONHASHSEED")
    return None if seed is None or seed == "random" else seed


def use_ray_cluster_token() -> None:
    """Ray (2.59 on) turns token authentication on for a cluster made by `ray start`, but a
    driver joining it sends its token only with RAY_AUTH_MODE=token; a token-sending driver also
    joins a cluster without authentication. So: token mode whenever a token is there to send
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or `ray start`'s ~/.ray/auth_token), unless the
    operator chose a mode. Ray reads it when first imported: call this before."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def default_omp_wait_policy() -> None:
    """Make OpenMP threads sleep rather than spin while they wait, unless the user chose.

    Spinning threads make small matmuls many times slower whenever the cores are shared with
    anything else (BENCHMARKS.md, "Intel Xeon (AVX-512 BF16, no AMX): where the 64-row threshold
    comes from"); libgomp reads the variable once, when torch loads, so this runs before torch is
    imported.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def omp_threads_sleep() -> bool:
    """Whether OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, the
    default `default_omp_wait_policy` sets) rather than spin for a while."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def prepend_to_path(directory: str) -> None:
    """Put `directory` first on PATH (once) for the subprocesses this process starts."""
    path = os.environ.get("PATH", "")
    if directory not in path.split(os.pathsep):
        os.environ["PATH"] = directory + os.pathsep + path if path else directory


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created with its parents) between processes; it dies with
    its process, so a killed holder never leaves it stale."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kv_store_default_enabled() -> bool:
    """Whether the disk tier is on when the caller does not say: unless PREFIXSERVE_KV_STORE
    turns it off."""
    return env_flag("PREFIXSERVE_KV_STORE") is not False


def kv_store_root() -> Path:
    """The default directory of the prefix cache's disk tier: <cache_root()>/kv_store."""
    return cache_root() / "kv_store"
