"""The fallback paths of a CPU kind, and what the CPU is.

bf16 linears take the native GEMM (csrc/linear/gemm_bf16.cpp, one summation order at every row
count) on every CPU where its vector tiles run (AVX-512 or AVX2), whichever kind: its tile
family per row class is chosen by a measurement on the host (`calibration.py`), not by a table.
`PREFIXSERVE_NATIVE_GEMM=0` turns it off (to compare against the paths below), `=1` forces it
even on the portable loop.

`CPU_TABLE` holds, per kind of CPU, what the model does where the native GEMM is off or
unavailable (no compiler, `PREFIXSERVE_KERNELS=0`, a non-x86 CPU), from numbers measured once
on one host of each kind (BENCHMARKS.md, "Model speed"):
- a bf16 `Linear` (`layers.Linear`): oneDNN's bf16 GEMM (on pre-packed weights where oneDNN can
  pack bf16, plain `F.linear` elsewhere), or `F.linear` in fp32 from an fp32 copy of the weight
  from some row count on (`benchmarks/bench_gemm.py`). `PREFIXSERVE_FP32_PREFILL=1/0`
  overrides it.
- attention (`attention.KERNEL_MAX_QUERIES`): the native paged-attention kernel for chunks of
  fewer queries than this, PyTorch's flash SDPA for longer ones (`benchmarks/bench_attention.py`).
  Only where the paged kernel's keys-in-lanes path and the long-chunk kernel do not serve the
  model: where they do (AVX512-BF16, bf16), every chunk goes to them (model_runner.py), and in
  the batch-invariant mode every chunk goes to the paged kernel.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

from prefixserve.settings import native_gemm


@dataclass(frozen=True, slots=True)
class CpuPaths:
    """The model's paths on one kind of CPU.

    `fp32_min_rows`: bf16 linears compute batches of at least this many rows from an fp32 copy;
    None keeps no fp32 copy at all (bf16 is the faster path at every row count). `lm_head_fp32`:
    the LM head keeps an fp32 copy too (up to `layers.LM_HEAD_FP32_MAX_ELEMENTS`).
    `kernel_max_queries`: chunks of fewer queries attend through the native kernel."""

    fp32_min_rows: int | None
    lm_head_fp32: bool
    kernel_max_queries: int
    measured: str  # where the row's numbers come from


# Keyed by `cpu_kind()`. Each row's reasons were measured on 2 threads (GEMMs:
# `benchmarks/bench_gemm.py` on the default model's shapes; attention:
# `benchmarks/bench_attention.py`); the numbers are in the BENCHMARKS.md entry each row names.
CPU_TABLE: dict[str, CpuPaths] = {
    # Intel Sapphire Rapids and later: AMX tiles make bf16 the fast path (issue 13: transformers'
    # plain bf16 prefill beat our fp32 one on such a host, `benchmarks/bench_model.py`).
    # Attention: as the Intel row (not measured on AMX).
    "amx": CpuPaths(None, False, 12, "AMX host, issue 13's run"),
    # AMD Zen 5 (EPYC, family 26): full-width AVX-512 with native bf16 dot products. Packed bf16
    # beats the fp32 copy at every row count from 4, by most at prefill sizes, and the whole
    # model's 512-token prefill ran much faster without the fp32 copy from 64 rows than with it.
    # Zen 4 double-pumps the same instructions: bf16 keeps its 2x FLOPs per instruction over
    # fp32 FMAs (reasoned, not measured). Attention: the kernel beats SDPA for chunks of 4-64
    # queries over a 1,024-token prefix and on a 512-token prompt, and loses on a 2,048-token
    # prompt (all: BENCHMARKS.md, "Per-CPU paths, a streaming decode kernel and the llama.cpp
    # peer"). Since the native prefill kernel (attention.PREFILL_MIN_QUERIES), chunks of 32+
    # queries go to that instead wherever it is built: this number only matters without it.
    "avx512_bf16_amd": CpuPaths(None, False, 513, "AMD EPYC Zen 5, 2026-12-02"),
    # Intel Xeon with avx512_bf16 and no AMX: a VDPBF16PS retires at a fraction of an fp32
    # FMA's rate (a register loop's peaks: BENCHMARKS.md, "The native GEMM: one bf16 linear for
    # every row count"), so oneDNN's bf16 GEMM runs slower than MKL's fp32 one from a few
    # hundred rows (BENCHMARKS.md, "After the CPU kernels (quiet machine)"). The native GEMM
    # (fp32 FMAs on bf16 weights widened in registers) matches fp32 MKL from 512 rows, beats
    # oneDNN at 8-64 rows and the streaming kernel at 1-8 (BENCHMARKS.md, "The native GEMM: one
    # bf16 linear for every row count"; `bench_gemm.py --native`); it now takes every CPU kind
    # with vector tiles, and this row says what happens without it.
    # Attention: the kernel wins at 4-8 queries over a 1,024-token prefix, and the crossover
    # lies between 16 and 32 (BENCHMARKS.md, "After the CPU kernels (quiet machine)").
    "avx512_bf16_intel": CpuPaths(64, False, 12, "Intel Xeon without AMX, 2026-12-03"),
    # AVX-512 without bf16 instructions (Skylake-X, Ice Lake): taken to behave as the Intel row
    # (not measured on such a host).
    "avx512": CpuPaths(64, False, 12, "not measured: as avx512_bf16_intel"),
    # AVX2 only (AMD EPYC without AVX-512): oneDNN cannot pack bf16 and plain bf16 `F.linear`
    # runs several times slower than fp32 from 16 rows. The whole model's decode at batch 8 ran
    # faster in bf16 than in fp32 (twice the bytes), at batch 16 slower; SmolLM2's LM head ran
    # faster in fp32 at 16 rows, slower at 1 row (BENCHMARKS.md, "fp32 from 16 rows on
    # AVX2-only CPUs"). Attention: the Intel threshold (not measured here).
    "avx2": CpuPaths(16, True, 12, "AMD EPYC, AVX2 only, 2026-12-02"),
    # Not x86 (aarch64 with NEON, ...): the kernels' portable loops; taken to behave as the AVX2
    # row (not measured on such a host).
    "portable": CpuPaths(16, True, 12, "not measured: as avx2"),
}


@functools.cache
def bf16_packing_supported() -> bool:
    """Whether oneDNN can pre-pack bf16 weights here: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses on an AVX2-only CPU (such as some AMD EPYC hosts)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return False
    return True


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("vendor_id", "model name", "flags" or
    "Features", ...); empty where there is no such file."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_vendor() -> str:
    """The vendor ("GenuineIntel", "AuthenticAMD", ...), "" if unknown."""
    return cpuinfo().get("vendor_id", "")


def cpu_kind() -> str:
    """This CPU's row of CPU_TABLE."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "portable"
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if not bf16_packing_supported():
        return "avx2"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16_amd" if cpu_vendor() == "AuthenticAMD" else "avx512_bf16_intel"
    return "avx512"


def cpu_paths_here() -> CpuPaths:
    """The paths of this CPU (`CPU_TABLE[cpu_kind()]`)."""
    return CPU_TABLE[cpu_kind()]


def native_gemm_wanted(tiles: str | None) -> bool:
    """Whether bf16 linears should take the native GEMM, given the build's FMA tiles (`tiles`:
    "avx512", "avx2", "portable", None without kernels): `PREFIXSERVE_NATIVE_GEMM=1/0`, or else
    wherever vector tiles run (the portable loop is a scalar loop, far too slow for a model)."""
    if tiles is None:
        return False
    flag = native_gemm()
    return flag if flag is not None else tiles != "portable"


_FLAGS_OF_INTEREST = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_bf16",
)


def describe_cpu() -> str:
    """One line for benchmark records: model name, the GEMM-relevant flags, and the fallback
    table's row (`calibration.describe_calibration` says what the native kernels chose)."""
    name = cpuinfo().get("model name", "")
    flags = set(cpuinfo().get("flags", "").split())
    present = [flag for flag in _FLAGS_OF_INTEREST if flag in flags]
    return (
        f"{name or 'unknown CPU'} ({cpu_vendor() or '?'}) | flags {' '.join(present)} | "
        f"fallback row {cpu_kind()}"
    )
