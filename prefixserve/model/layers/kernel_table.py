"""The compiled kernels the model's layers call, looked up once by name (None where
unavailable): one table for linear.py, common.py and lora/layers.py, and the one place tests and
benchmarks swap a kernel for None or a stand-in (`_kernels`)."""

from __future__ import annotations

from prefixserve.model.kernels.build import (
    decoder_layer_class,
    gemm_bf16_tiles,
    linear_bf16_packed_kernels,
    linear_bf16_small_kernel,
    linear_int8_kernel,
    lora_add_kernel,
    rms_norm_kernel,
    rope_write_kv_kernel,
)
from prefixserve.model.kernels.calibration import calibrate_gemm
from prefixserve.model.kernels.cpu_paths import native_gemm_wanted

# The compiled kernels by name, each looked up once (None where unavailable); tests and
# benchmarks put None or a stand-in here to take the PyTorch path.
_kernels: dict[str, object] = {}


def _native_gemm_kernels() -> object:
    """(pack, run, run_gated) of the native GEMM (`build.linear_bf16_packed_kernels`) where bf16
    linears take it (`cpu_paths.native_gemm_wanted`: wherever its vector tiles run), its tile
    families chosen by the host's calibration (`calibration.calibrate_gemm`). None elsewhere."""
    if not native_gemm_wanted(gemm_bf16_tiles()):
        return None
    calibrate_gemm()
    return linear_bf16_packed_kernels()


def _any_native_gemm_kernels() -> object:
    """The native GEMM's kernels whatever the CPU table says, where they run on vector tiles
    (AVX-512 or AVX2); None on the portable loop (a scalar loop: far too slow for a model)."""
    if gemm_bf16_tiles() in (None, "portable"):
        return None
    return linear_bf16_packed_kernels()


_KERNEL_LOOKUPS = {
    "gemm": _native_gemm_kernels,
    "decoder_layer": decoder_layer_class,  # native_layer.py
    # The native GEMM whatever the CPU table says (AVX-512 or AVX2 tiles): batch-invariant calls
    # where oneDNN cannot pack bf16 (Linear._invariant_gemm).
    "gemm_any": _any_native_gemm_kernels,
    "linear_small": linear_bf16_small_kernel,
    "linear_int8": linear_int8_kernel,  # 8-bit weights (Linear.set_int8)
    "lora_add": lora_add_kernel,  # lora/layers.py
    "rope_kv": rope_write_kv_kernel,
    "rms_norm": rms_norm_kernel,
}


def _kernel(name: str) -> object:
    """The compiled kernel `name` of `_KERNEL_LOOKUPS`, looked up once; None if unavailable."""
    kernel = _kernels.get(name, _kernels)
    if kernel is _kernels:
        kernel = _kernels[name] = _KERNEL_LOOKUPS[name]()
    return kernel


# The same lookup for the modules beside the model (lora/layers.py).
compiled_kernel = _kernel
