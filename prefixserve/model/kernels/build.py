"""Native CPU kernels, compiled from `csrc/` on first use (a C++ compiler and ninja are needed).

`paged_attention_kernel()` and `rms_norm_kernel()` return the compiled extension's functions, or
None when it cannot be built (no compiler, a failed build: a warning says why) or is turned off
with `PREFIXSERVE_KERNELS=0`; callers then use their pure-PyTorch paths, which compute the same
thing. The build (~1 min) is cached per CPU under `$PREFIXSERVE_CACHE_DIR/kernels/` since it
is compiled with `-march=native` (and for one torch version and Python ABI), one directory per
sources digest and checkout, the six most recently used kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixserve.model.kernels import pch
from prefixserve.model.kernels.cpu_paths import cpuinfo
from prefixserve.settings import (
    cache_root,
    file_lock,
    kernel_march,
    kernels_enabled,
    prepend_to_path,
)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_NAME = "prefixserve_paged_attention"
# csrc/ by purpose (csrc/README.md): each folder is on the include path, so a source includes
# a header by its name alone.
_GROUPS = ("attention", "linear", "layer", "common")
_SOURCES = [
    _CSRC / name
    for name in (
        "bindings.cpp",
        "attention/paged_attention.cpp",
        "attention/paged_lanes.cpp",
        "attention/prefill_attention.cpp",
        "linear/gemv.cpp",
        "linear/linear_int8.cpp",
        "linear/linear_q4k.cpp",
        "linear/linear_q6k.cpp",
        "linear/gemm_bf16.cpp",
        "linear/lora.cpp",
        "layer/rope_kv.cpp",
        "layer/decoder_layer.cpp",
        "layer/rms_norm.cpp",
    )
]


def _digest(paths: list[Path], length: int) -> str:
    """A digest of these files' paths (under csrc/) and bytes."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(_CSRC).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:length]


def _native_files(pattern: str) -> list[Path]:
    return [path for path in _CSRC.rglob(pattern) if path.suffix in (".cpp", ".h")]


def sources_digest() -> str:
    """A digest of every source and header of csrc/: what a build of the kernels computes, and
    how fast (the calibration's cache is kept per build, `calibration.py`)."""
    return _digest(_native_files("*"), 12)


def _headers_digest() -> str:
    """A digest of csrc/'s headers: torch rebuilds an extension when its sources or flags
    change, not its headers, so the digest goes into the flags."""
    return _digest(_native_files("*.h"), 16)


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build_tag() -> str:
    """A short tag of what a build depends on: this CPU's model and feature flags (it is built
    with -march=native, or PREFIXSERVE_KERNEL_MARCH's target, named too), torch's version and
    the Python ABI."""
    import sys

    import torch

    text = f"{platform.machine()} torch {torch.__version__} {sys.implementation.cache_tag}\n"
    march = kernel_march()
    if march != "native":
        text += f"march: {march}\n"
    info = cpuinfo()
    for field in ("model name", "flags", "Features"):
        text += f"{field}: {info.get(field, '')}\n"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cflags() -> list[str]:
    """-O3 for this CPU (-march=native unless PREFIXSERVE_KERNEL_MARCH names another target),
    OpenMP, and on x86-64 512-bit vectors where the target has them (an x86-only flag: other
    compilers' targets, such as aarch64's, refuse it)."""
    flags = ["-O3", f"-march={kernel_march()}", "-fopenmp", "-fno-strict-aliasing"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")
    return [*flags, f"-DPREFIXSERVE_HEADERS={_headers_digest()}"]


def _build() -> Any:
    import ninja  # the pip package puts a ninja binary beside it; torch looks on PATH
    from torch.utils import cpp_extension

    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir:
        prepend_to_path(bin_dir)
    build_dir = _build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    build_dir.touch()  # the most recently used builds are kept (`_prune_builds`)
    # torch's own build lock (a `lock` file it polls forever) outlives a killed build and would
    # hang every later start; an flock dies with its process, so take one around the build and
    # clear a leftover torch lock while holding it (only this function builds here).
    _prune_builds(build_dir.parent, keep=build_dir)
    with file_lock(build_dir / _LOCK_NAME):
        (build_dir / "lock").unlink(missing_ok=True)
        includes = [_CSRC / group for group in _GROUPS]
        cflags = _cflags()
        pch_dir = pch.precompile(build_dir, _CSRC / "common", _NAME, includes, cflags)
        if pch_dir is not None:  # first, so that GCC finds the headers' .gch files there
            includes.insert(0, pch_dir)
            cflags.append("-Winvalid-pch")
        module = cpp_extension.load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            extra_include_paths=[str(path) for path in includes],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
        if pch_dir is not None:
            pch.release(pch_dir)
        return module


# The builds kept per CPU tag (each checkout of other sources has its own).
MAX_KEPT_BUILDS = 6
_LOCK_NAME = ".prefixserve.lock"


def _build_dir() -> Path:
    """Where this CPU's build of these sources from this checkout lives: one directory per
    sources digest and csrc/ path (torch's build compares the sources and include paths and
    rebuilds in place when they differ, so two checkouts sharing one directory would rebuild
    each other's build at every start, each waiting on the other's lock)."""
    key = hashlib.sha256(f"{sources_digest()} {_CSRC.resolve()}".encode()).hexdigest()[:12]
    return cache_root() / "kernels" / _build_tag() / key


def _prune_builds(root: Path, keep: Path) -> None:
    """Remove the builds under `root` past the MAX_KEPT_BUILDS most recently used, each only
    when no process is building it (its lock is free); a process that loaded one keeps its
    mapped library."""
    builds = sorted(
        (p for p in root.iterdir() if p.is_dir() and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[MAX_KEPT_BUILDS - 1 :]:
        with contextlib.suppress(OSError), open(old / _LOCK_NAME, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)


def _module() -> Any:
    """The compiled extension, built on the first call of the process; None if unavailable."""
    if not kernels_enabled():
        return None
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _build()
            except Exception as exc:  # no compiler, no ninja, a failed build
                logger.warning(
                    "prefixserve's CPU kernels are unavailable (%s: %s); using PyTorch paths",
                    type(exc).__name__,
                    exc,
                )
                _state["module"] = None
    return _state["module"]


def paged_attention_kernel() -> Callable[..., None] | None:
    """`paged_attention(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
    window, threads=0)` (its work items on the caller and `threads - 1` stream-pool helpers; 0:
    OpenMP's thread count), or None when the kernels are unavailable."""
    module = _module()
    return None if module is None else module.paged_attention


def paged_attention_portable_kernel() -> Callable[..., None] | None:
    """`paged_attention` on its portable path (fp32 tiles) whatever the CPU, for benchmarks and
    tests that compare it with the keys-in-lanes path; None when the kernels are unavailable."""
    module = _module()
    return None if module is None else module.paged_attention_portable


def attention_kernels_agree() -> bool:
    """Whether the paged kernel's bf16 path has the long-chunk kernel's arithmetic in this build
    (csrc/attention/attn_lanes_bf16_avx512.h; on 256-bit vectors with the same bits where the
    CPU has AVX2 but not AVX512-BF16): then a query gets the same bits from either, and from any
    kind of CPU with these tiles, so batch-invariant runs may use the long-chunk kernel where it
    is built."""
    return attention_lanes_width() > 0


def attention_lanes_width() -> int:
    """The width of the paged kernel's keys-in-lanes tiles in this build: 512 (AVX512-BF16 and
    VNNI), 256 (AVX2 and FMA: the same bits) or 0 (none: the portable path)."""
    module = _module()
    return 0 if module is None else int(module.paged_attention_lanes_width())


def attention_portable_width() -> int:
    """The width of the paged kernel's portable-path vectors in this build: 512 (its fp32 tiles
    in AVX-512 intrinsics) or 0 (loops the compiler vectorizes, which may round otherwise): two
    builds' portable paths are one arithmetic only at the same width. 0 without kernels."""
    module = _module()
    return 0 if module is None else int(module.paged_attention_portable_width())


def paged_attention_avx2_kernel() -> Callable[..., bool] | None:
    """`paged_attention` on the 256-bit keys-in-lanes tiles whatever the build's widest (returns
    False, nothing written, where they do not serve the call): for tests and benchmarks that
    compare them with the 512-bit tiles. None when the kernels are unavailable."""
    module = _module()
    return None if module is None else module.paged_attention_avx2


def prefill_attention_kernel() -> Callable[..., None] | None:
    """`prefill_attention(out, q, k, v, scale, threads=0)`: causal attention of one long bf16
    chunk over contiguous K/V rows (csrc/attention/prefill_attention.cpp) on the caller and
    `threads - 1` stream-pool helpers, or None when the kernels are unavailable or this build has
    no AVX512-BF16 loop for it."""
    module = _module()
    if module is None or not module.prefill_attention_ready():
        return None
    return module.prefill_attention


def linear_bf16_small_kernel() -> Callable[..., None] | None:
    """`linear_bf16_small(out, x, weight, bias, threads)`: a bf16 linear for a few rows, on the
    caller and `threads - 1` helper threads of its own (csrc/common/stream_pool.h), or None."""
    module = _module()
    return None if module is None else module.linear_bf16_small


def linear_int8_kernel() -> Callable[..., None] | None:
    """`linear_int8(out, x, codes, scales, bias, act, residual, threads)`: a linear over 8-bit
    weight codes with group scales (csrc/linear/linear_int8.cpp: one summation order per output,
    on every CPU kind), or None without the kernels."""
    module = _module()
    return None if module is None else module.linear_int8


def linear_int8_family() -> str | None:
    """The vector family `linear_int8` was built with ("avx512", "avx2", "portable"), or None."""
    module = _module()
    return None if module is None else str(module.linear_int8_family())


def linear_bf16_packed_kernels() -> tuple[Callable[..., Any], ...] | None:
    """(`pack_bf16_gemm(weight) -> packed`, `linear_bf16_packed(out, x, packed, N, bias,
    threads)`, `linear_bf16_packed_gated(out, x, packed, N, bias, act, threads)`):
    csrc/linear/gemm_bf16.cpp's bf16 linear for every row count, one summation order per output
    (batch-invariant), on the stream pool's threads, and its gated-MLP form (out = act(gate) *
    up, act 1 SiLU, 2 GELU tanh); or None."""
    module = _module()
    if module is None:
        return None
    return (module.pack_bf16_gemm, module.linear_bf16_packed, module.linear_bf16_packed_gated)


def gemm_bf16_vectorized() -> bool:
    """Whether the built `linear_bf16_packed` has its AVX-512 tiles (fast); False when the
    kernels are unavailable or built without them (the portable loop: same sums, slow)."""
    module = _module()
    return module is not None and bool(module.gemm_bf16_vectorized())


def gemm_bf16_tiles() -> str | None:
    """The build's FMA tiles of the native GEMM: "avx512", "avx2" (AVX2-only CPUs: the AVX-512
    tiles' sums at half the width) or "portable" (a scalar loop, same sums, slow); None when
    the kernels are unavailable. The families calls take: `calibration.calibrate_gemm`."""
    module = _module()
    return None if module is None else str(module.gemm_bf16_tiles())


def lora_add_kernel() -> Callable[..., None] | None:
    """`lora_add(out, x, a, blocks, meta, rows)`: one adapter's LoRA update of one linear for a
    few bf16 rows (csrc/linear/lora.cpp; the layout of `blocks` and `meta`:
    `lora.adapter.LoRAWeights`), or None."""
    module = _module()
    return None if module is None else module.lora_add


def rope_write_kv_kernel() -> Callable[..., None] | None:
    """`rope_write_kv(qkv, cos, sin, q_heads, kv_heads, k_cache, v_cache, slots)`: rotary on the
    q and k heads of a fused qkv in place (PyTorch's roundings), then k and v into the cache
    slots; or None."""
    module = _module()
    return None if module is None else module.rope_write_kv


def rope_kv_vectorized() -> bool:
    """Whether the built `rope_write_kv` has its AVX512-BF16 vector loop (fast at any size in
    bf16); False when unavailable or built without it (then it is fast only for a few tokens)."""
    module = _module()
    return module is not None and bool(module.rope_kv_vectorized())


def decoder_layer_class() -> Any:
    """`DecoderLayerBf16(input_norm, post_norm, eps, qkv, o, gate_up, down, heads, kv_heads,
    head_dim, scale, act)`: a Llama-family decoder layer bound for one native call per layer
    (csrc/layer/decoder_layer.cpp; each linear a (packed, out_features, bias, next_packed) tuple of
    `linear_bf16_packed`'s or a (codes, scales, bias) tuple of `linear_int8`'s), or None without
    the kernels or the GEMM's vector tiles (the layer runs on every tile family the GEMM
    selects: AVX-512, bf16 dot products or AVX2)."""
    module = _module()
    if module is None or module.gemm_bf16_tiles() == "portable":
        return None
    return module.DecoderLayerBf16


def rms_norm_kernel() -> Callable[..., None] | None:
    """`rms_norm(out, x, weight, eps, offset)` over rows with a contiguous last dim, or None."""
    module = _module()
    return None if module is None else module.rms_norm


if __name__ == "__main__":  # `python -m prefixserve.model.kernels.build`: build ahead of first use
    import time

    start = time.perf_counter()
    state = "ready" if _module() is not None else "unavailable (PyTorch paths will be used)"
    print(f"prefixserve CPU kernels: {state} ({time.perf_counter() - start:.1f} s)")
