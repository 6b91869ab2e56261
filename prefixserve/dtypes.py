"""The dtype names prefixserve accepts, in one place (no torch here: config validation uses it).

Canonical names are torch's ("bfloat16", "float32"); "bf16" and "fp32" are aliases. float16 is
refused with the reason: this class of CPU has no fast fp16 matmul.
"""

from __future__ import annotations

SUPPORTED_DTYPES: tuple[str, ...] = ("bfloat16", "float32")
DTYPE_ALIASES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}
_FP16_NAMES = ("float16", "fp16", "half")
BYTES_PER_ELEMENT: dict[str, int] = {"bfloat16": 2, "float32": 4}


def canonical_dtype(dtype: object) -> str:
    """The canonical name of a dtype given by name (any case, aliases too) or as a torch.dtype.

    Raises ValueError naming the allowed names; float16 is refused with the reason.
    """
    name = str(dtype).removeprefix("torch.").lower()
    if name in _FP16_NAMES:
        raise ValueError(
            f"dtype {dtype!r} is not supported: this CPU has no fast float16 matmul (under "
            "3 GFLOP/s against ~400 in bfloat16); use 'bfloat16' (default) or 'float32'"
        )
    name = DTYPE_ALIASES.get(name, name)
    if name not in SUPPORTED_DTYPES:
        allowed = sorted((*SUPPORTED_DTYPES, *DTYPE_ALIASES))
        raise ValueError(f"dtype must be one of {allowed}, got {dtype!r}")
    return name
