"""The 8-bit KV cache: how a row of K or V (one token, one KV head) is stored and read back.

`--kv-cache-dtype` (`CacheConfig.kv_cache_dtype`): "auto"/"bf16" keep the model's dtype; "int8"
and "fp8_e4m3" store each row as `head_dim` 8-bit codes followed by its scale, an fp32 in the
row's last 4 bytes, so a row is `head_dim + 4` bytes (68 for a 64-dim head, against 128 in bf16).

- The scale is the row's absolute maximum over the format's largest code (127 for int8, 448 for
  fp8 e4m3), computed when the token's K/V are written and never changed after: a row's bytes
  depend on that row alone, not on the rest of the step or of the block, so a cache hit (from
  the pool or the disk tier) is the cold start's bytes, and a batch-invariant engine stays
  batch-invariant in each KV dtype.
- int8 codes are round(x / scale) (ties to even), clamped to [-127, 127]; fp8 codes are
  PyTorch's float8_e4m3fn of x / scale (round to nearest even).
- Read back, a value is code * scale in fp32: here (`dequantize_rows`, the PyTorch paths) and in
  the paged-attention kernel (`csrc/attention/paged_attention.cpp`, the same products in registers).
- With the scale in the row, a cache is still one tensor per layer and K/V each, of shape
  [blocks, block_size, kv_heads, head_dim + 4], dtype int8 for int8 codes and uint8 for fp8
  e4m3 bits (so the kernels and the disk tier's layout tell the two apart): block copies (the
  disk tier, `kv_store/worker.py`) carry the scales with the codes without knowing about them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "KVFormat", "dequantize_rows", "kv_format", "quantize_rows"]

SCALE_BYTES = 4
# The largest code of each 8-bit format: a row's absolute maximum maps to it.
_MAX_CODE = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How an engine stores K/V: `name` ("bf16", "float32", "int8" or "fp8_e4m3"), the tensor
    dtype of the cache and the bytes of one row of `head_dim` values."""

    name: str
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in _MAX_CODE

    def row_width(self, head_dim: int) -> int:
        """The cache tensor's last dimension for rows of `head_dim` values."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty(0, dtype=self.storage).element_size()


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The storage of `kv_cache_dtype` for a model computing in `model_dtype`; ValueError for
    a name that is not a KV dtype, or "bf16" for a model that is not bf16 (K/V would be rounded
    to another dtype than the model's: ask for an 8-bit format, or "auto")."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype in _MAX_CODE:
        return KVFormat(kv_cache_dtype, torch.int8 if kv_cache_dtype == "int8" else torch.uint8)
    if kv_cache_dtype == "bf16" and model_dtype != torch.bfloat16:
        raise ValueError(
            f"kv_cache_dtype 'bf16' needs a bfloat16 model (this one computes in {model_dtype}); "
            "use 'auto', 'int8' or 'fp8_e4m3'"
        )
    return KVFormat(
        str(model_dtype).removeprefix("torch.").replace("bfloat16", "bf16"), model_dtype
    )


def quantize_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows `[..., head_dim]` (any float dtype) as the cache stores them: `[..., head_dim + 4]`
    of `fmt.storage`, the codes then the fp32 scale's bytes. A row of zeros gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _MAX_CODE[fmt.name], torch.ones_like(amax))
    y = xf / scale
    if fmt.name == "int8":
        codes = torch.round(y).clamp_(-127.0, 127.0).to(torch.int8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(fmt.storage)], dim=-1)


def dequantize_rows(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows `[..., head_dim + 4]` back to values `[..., head_dim]` in `dtype` (code *
    scale in fp32, then rounded to `dtype`)."""
    codes, scale_bytes = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)
    if fmt.name == "int8":
        values = codes.float()
    else:
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)
